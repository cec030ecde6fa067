"""Progress on a terminal is tqdm's bar; in a log (stderr not a terminal) it is a plain line every `every_s` seconds
and one at the end, never a `\\r` redraw; a short run writes none."""

from __future__ import annotations

import io

from dreamzero.progress import PlainProgress, iterate, progress_bar


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_a_plain_line_per_interval_and_one_at_the_end():
    log, clock = io.StringIO(), Clock()
    bar = PlainProgress(total=10, desc="DROID eval", unit="step", stream=log, every_s=30.0, clock=clock)
    with bar:
        for i in range(10):
            clock.now = 10.0 * (i + 1)  # a step every 10 s: a line at 30, 60 and 90 s
            bar.set_postfix_str(f"scene 1 ep {i}")
            bar.update(1)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines == [
        "DROID eval: 3/10 step (0.10 step/s), scene 1 ep 2",
        "DROID eval: 6/10 step (0.10 step/s), scene 1 ep 5",
        "DROID eval: 9/10 step (0.10 step/s), scene 1 ep 8",
        "DROID eval: 10/10 step (0.10 step/s), scene 1 ep 9",  # the end
    ]
    bar.close()  # closing twice writes nothing more
    assert len(log.getvalue().splitlines()) == 4


def test_a_short_run_in_a_log_writes_nothing():
    log = io.StringIO()
    assert list(iterate(range(3), desc="episodes", unit="ep", stream=log)) == [0, 1, 2]
    assert log.getvalue() == ""


def test_a_terminal_gets_the_bar_and_no_progress_gets_nothing():
    from tqdm import tqdm

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    with progress_bar(2, "LIBERO eval", "episode", stream=term) as bar:
        assert isinstance(bar, tqdm)
        bar.update(2)
    assert "LIBERO eval" in term.getvalue() and "\r" in term.getvalue()
    log = io.StringIO()
    with progress_bar(2, "x", "ep", enabled=False, stream=log) as bar:
        bar.update(2)
    assert log.getvalue() == "" and not isinstance(progress_bar(stream=log), tqdm)
