"""`dreamzero-franka` CLI: flag validation, and whole sessions on the simulated arm against a fake OpenPI server."""

from __future__ import annotations

import json

import pytest

from dreamzero_franka.cli import main
from tests.support.franka import FakeOpenPIServer

SIM = ["--robot", "sim", "--cameras", "synthetic", "--unattended", "--no-video", "--control-hz", "30"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--robot", "franky"], "--robot-ip is required"),
        (["--robot", "sim", "--cameras", "realsense", "--wrist", "1"], "--exterior-0, --exterior-1"),
        ([*SIM, "--workspace", "0,0,0,1,1"], "--workspace must be 6"),
        ([*SIM, "--dynamics", "0.5,0.1"], "--dynamics must be 3"),
        ([*SIM, "--camera-size", "640"], "--camera-size"),
        ([*SIM, "--episodes", "0"], "--episodes"),
        ([*SIM, "--open-loop-horizon", "0"], "open_loop_horizon"),
        ([*SIM, "--max-step", "2"], "max_step_rad"),
        ([*SIM, "--server", "tcp://x:1"], "--server: expected a ws://"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    base = ["--server", "ws://127.0.0.1:1", "--prompt", "x"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_exits_2(capsys):
    assert main(["--server", "ws://127.0.0.1:9", "--prompt", "x", "--timeout-s", "2", *SIM, "--log-dir", ""]) == 2
    assert "ServerUnavailableError" in capsys.readouterr().err


def test_two_unattended_episodes_on_the_sim_arm(tmp_path, capsys):
    with FakeOpenPIServer() as server:
        code = main(
            [
                "--server",
                server.url,
                "--prompt",
                "stack the cups",
                *SIM,
                "--episodes",
                "2",
                "--max-steps",
                "10",
                "--log-dir",
                str(tmp_path),
            ]  # fmt: skip
        )
    assert code == 0
    summaries = json.loads((tmp_path / "session_summary.json").read_text())
    assert [s["status"] for s in summaries] == ["completed", "completed"]
    assert [s["server_calls"] for s in summaries] == [2, 2]
    # the first session is released when the second starts
    assert server.events[2] == ("reset", summaries[0]["session_id"])
    assert [e[0] for e in server.events] == ["infer", "infer", "reset", "infer", "infer"]
    assert server.sessions() == [s["session_id"] for s in summaries]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["episode_index"] for p in printed] == [0, 1]


def test_server_killed_mid_session_exits_1(tmp_path):
    with FakeOpenPIServer(kill_after_infers=2) as server:
        code = main(
            [
                "--server",
                server.url,
                "--prompt",
                "x",
                *SIM,
                "--max-steps",
                "30",
                "--log-dir",
                str(tmp_path),
                "--timeout-s",
                "3",
            ]  # fmt: skip
        )
    assert code == 1
    summary = json.loads((tmp_path / "episode_0000" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith("server_unreachable")
