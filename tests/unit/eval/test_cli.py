"""`dreamzero-eval`: defaults, argument errors, and a full run through main() against the fake OpenPI server."""

import json

import pytest

from eval.cli import main, parse_args
from tests.support.evaluation import FakeOpenPIServer


def test_defaults_match_the_issue():
    args = parse_args([])
    assert (args.sim, args.policy, args.host, args.port) == ("mujoco", "openpi", "127.0.0.1", 8000)
    assert (args.open_loop_horizon, args.episodes, args.scenes) == (8, 1, [1, 2, 3])
    assert str(args.out).startswith("runs/droid-eval-")


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--scenes", "5"])
    with pytest.raises(SystemExit):
        parse_args(["--policy", "grpc"])
    assert main(["--episodes", "0"]) == 2
    assert "--episodes: expected >= 1" in capsys.readouterr().err


def test_main_runs_and_writes_everything(tmp_path, capsys):
    with FakeOpenPIServer() as server:
        code = main(
            [
                "--scenes",
                "2",
                "--max-steps",
                "9",
                "--render",
                "fast",
                "--image-size",
                "90",
                "160",
                "--port",
                str(server.port),
                "--timeout-s",
                "10",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        assert server.infer_calls == 2
    assert code == 0
    out = capsys.readouterr().out
    assert "pick up the can and put it in the mug" in out and "report.html" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["extra"] == {"simulator": "mujoco", "policy": "openpi", "render": "fast"}
    for path in ("report.html", "videos/scene2_ep000.mp4", "episodes/scene2_ep000.json", "summary.md"):
        assert (tmp_path / path).is_file(), path
