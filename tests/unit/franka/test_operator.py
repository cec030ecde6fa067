"""Operator console: command parsing and an injected input stream."""

from __future__ import annotations

import io
import os
import time

import pytest

from dreamzero_franka.common.operator import Command, ConsoleOperator, Operator, parse_command


@pytest.mark.parametrize(
    "line, command",
    [
        ("s\n", Command.START),
        ("START", Command.START),
        (" p ", Command.PAUSE),
        ("r", Command.RESUME),
        ("a", Command.ABORT),
        ("y", Command.SUCCESS),
        ("failure", Command.FAILURE),
        ("\n", Command.NEXT),
        ("next", Command.NEXT),
        ("q", Command.QUIT),
        ("xyz", None),
    ],
)
def test_parse_command(line, command):
    assert parse_command(line) is command


def test_console_reads_an_injected_stream_and_quits_at_end_of_input():
    out = io.StringIO()
    op = ConsoleOperator(io.StringIO("s\nbogus\np\ny\n"), out)
    assert op.wait({Command.START}, "ready?", timeout_s=2) is Command.START
    deadline = time.monotonic() + 2
    seen: list[Command] = []
    while Command.QUIT not in seen and time.monotonic() < deadline:
        seen += op.poll()
        time.sleep(0.01)
    assert seen == [Command.PAUSE, Command.SUCCESS, Command.QUIT]  # end of input = quit
    assert "unknown command 'bogus'" in out.getvalue() and "ready?" in out.getvalue()
    op.close()


def test_console_wait_ignores_commands_that_do_nothing_now_and_times_out():
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd) as reader, os.fdopen(write_fd, "w") as writer:
        out = io.StringIO()
        op = ConsoleOperator(reader, out)
        assert op.wait({Command.SUCCESS, Command.FAILURE}, "label?", timeout_s=0.05) is None
        writer.write("p\nn\n")
        writer.flush()
        assert op.wait({Command.SUCCESS, Command.FAILURE}, "label?", timeout_s=2) is Command.FAILURE
        assert "'pause' does nothing now" in out.getvalue()
        op.close()


def test_unattended_operator_starts_and_never_labels():
    op = Operator()
    assert op.wait({Command.START, Command.QUIT}, "go?") is Command.START
    assert op.wait({Command.SUCCESS, Command.FAILURE, Command.NEXT}, "label?") is Command.NEXT
    assert op.poll() == []
