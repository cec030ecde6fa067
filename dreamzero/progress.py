"""Progress for the long commands (evaluations, metadata): tqdm's bar on a terminal, plain lines in a log.

A bar redraws itself with `\\r`, which a log file (stderr redirected, a job scheduler's capture) keeps as one growing
line of redraws; there the same progress is written as a plain line every `every_s` seconds and once at the end (a
run shorter than that writes none).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

#: seconds between two plain lines in a log
PLAIN_EVERY_S = 30.0


class PlainProgress:
    """tqdm's calls a runner makes (`update`, `set_postfix_str`, `set_postfix`, `close`, `with`), as plain lines."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str,
        stream: TextIO,
        every_s: float = PLAIN_EVERY_S,
        initial: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.desc, self.unit, self.stream, self.every_s = total, desc, unit, stream, every_s
        self.n, self.postfix, self.clock, self.closed = initial, "", clock, False
        self.start = self.last = clock()
        self.start_n = initial

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last >= self.every_s:
            self.last = now
            self._line(now)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def set_postfix(self, **fields: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in fields.items())

    def close(self) -> None:
        """The last line, for a run long enough to have had progress lines (a short one stays quiet)."""
        now = self.clock()
        if not self.closed and now - self.start >= self.every_s:
            self._line(now)
        self.closed = True

    def _line(self, now: float) -> None:
        done = f"{self.n}/{self.total}" if self.total else str(self.n)
        rate = (self.n - self.start_n) / max(now - self.start, 1e-9)
        tail = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {done} {self.unit} ({rate:.2f} {self.unit}/s){tail}", file=self.stream, flush=True)

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    stream: TextIO | None = None,
    every_s: float = PLAIN_EVERY_S,
    **bar_options: Any,
):
    """A tqdm bar when `stream` (default stderr) is a terminal, `PlainProgress` lines otherwise, a disabled bar
    when `enabled` is False (`--no-progress`)."""
    from tqdm import tqdm

    stream = stream or sys.stderr
    if not enabled:
        return tqdm(total=total, disable=True)
    if getattr(stream, "isatty", lambda: False)():
        return tqdm(total=total, desc=desc, unit=unit, file=stream, **bar_options)
    return PlainProgress(total, desc, unit, stream, every_s, initial=bar_options.get("initial", 0))


def iterate(items: Iterable, total: int | None = None, **options: Any) -> Iterator:
    """`items` with `progress_bar(**options)` advanced per item (closed at the end, or when the loop stops early)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with progress_bar(total=total, **options) as bar:
        for item in items:
            yield item
            bar.update(1)
