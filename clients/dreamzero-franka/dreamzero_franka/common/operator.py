"""Terminal controls for the operator: start, pause/resume, abort, label success/failure, next episode, quit.

Commands are typed as a word or its first letter followed by Enter (line input works over SSH and in tests):
    s / start     start the episode            p / pause   pause (hold the arm); again to resume
    r / resume    resume                       a / abort   stop the episode now (the arm holds)
    y / success   label success (ends it)      n / failure label failure (ends it)
    Enter / next  next episode                 q / quit    stop after this episode
A reader thread turns lines into `Command`s; the loop polls them without blocking. Any text stream can be injected
(tests pass a pipe or a StringIO). End of input counts as quit, so an unattended run stops cleanly.
"""

from __future__ import annotations

import enum
import queue
import sys
import threading
from collections.abc import Iterable
from typing import TextIO


class Command(enum.Enum):
    START = "start"
    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"
    SUCCESS = "success"
    FAILURE = "failure"
    NEXT = "next"
    QUIT = "quit"


_ALIASES = {
    "s": Command.START,
    "start": Command.START,
    "p": Command.PAUSE,
    "pause": Command.PAUSE,
    "r": Command.RESUME,
    "resume": Command.RESUME,
    "a": Command.ABORT,
    "abort": Command.ABORT,
    "y": Command.SUCCESS,
    "success": Command.SUCCESS,
    "n": Command.FAILURE,
    "failure": Command.FAILURE,
    "": Command.NEXT,
    "next": Command.NEXT,
    "q": Command.QUIT,
    "quit": Command.QUIT,
}

HELP = (
    "commands: [s]tart  [p]ause/resume  [r]esume  [a]bort  [y] success  [n] failure  Enter/next  [q]uit "
    "(type, then Enter)"
)


def parse_command(line: str) -> Command | None:
    """The command a line names, or None for unknown input."""
    return _ALIASES.get(line.strip().lower())


class Operator:
    """What the loop asks of an operator. The base class runs unattended: start every episode, never label."""

    def poll(self) -> list[Command]:
        """Commands typed since the last poll (never blocks)."""
        return []

    def wait(self, accepted: Iterable[Command], prompt: str, timeout_s: float | None = None) -> Command | None:
        """Block until one of `accepted` arrives (None on timeout). Unattended: START / NEXT at once."""
        accepted = set(accepted)
        for cmd in (Command.START, Command.NEXT):
            if cmd in accepted:
                return cmd
        return None

    def say(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleOperator(Operator):
    def __init__(self, stream: TextIO | None = None, out: TextIO | None = None):
        self._stream = stream if stream is not None else sys.stdin
        self._out = out if out is not None else sys.stdout
        self._queue: queue.Queue[Command] = queue.Queue()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="franka-operator", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # readline blocks; the thread is a daemon so an unfinished read never keeps the process alive
        for line in iter(self._stream.readline, ""):
            if self._closed.is_set():
                return
            cmd = parse_command(line)
            if cmd is None:
                self.say(f"unknown command {line.strip()!r}; {HELP}")
            else:
                self._queue.put(cmd)
        self._queue.put(Command.QUIT)  # end of input

    def poll(self) -> list[Command]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def wait(self, accepted: Iterable[Command], prompt: str, timeout_s: float | None = None) -> Command | None:
        accepted = set(accepted)
        self.say(prompt)
        while True:
            try:
                cmd = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                return None
            if cmd in accepted or cmd is Command.QUIT:
                return cmd
            self.say(f"{cmd.value!r} does nothing now; expected one of {sorted(c.value for c in accepted)}")

    def say(self, message: str) -> None:
        print(message, file=self._out, flush=True)

    def close(self) -> None:
        self._closed.set()
