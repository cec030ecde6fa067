"""The real franky code path against `franky-sim` (libfranka protocol on loopback, MuJoCo, headless).

franky-sim binds the first free 127.x address on ports 1337 (robot) / 1338 (gripper) and prints it; the `franky_sim`
fixture (tests/e2e/conftest.py over tests/support/franky_sim.py) reads it from stdout, and kills the simulator's
process group when the module is done. The policy server is a small fake OpenPI WebSocket server
(tests/support/franka.py) that records resets and session ids.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.franka import FakeOpenPIServer
from tests.support.franky_sim import SIM, SIM_GRIPPER_TIMEOUT_S

franky = pytest.importorskip("franky", reason="franky-control is not installed (./scripts/install.sh installs it)")

pytestmark = [
    pytest.mark.skipif(not os.path.exists(SIM), reason="franky-sim is not installed (pip install franky-sim)"),
    pytest.mark.timeout(300),
]


def _steps(episode_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (episode_dir / "steps.jsonl").read_text().splitlines()]


def test_two_episodes_through_the_cli_with_a_session_reset_between(franky_sim, tmp_path, capsys):
    from dreamzero_franka.cli import main
    from dreamzero_franka.droid.safety import SafetyConfig

    with FakeOpenPIServer() as server:
        code = main(
            [
                "--server",
                server.url,
                "--prompt",
                "put the cube in the bowl",
                "--robot",
                "franky",
                "--robot-ip",
                franky_sim,
                "--no-realtime",
                "--cameras",
                "synthetic",
                "--episodes",
                "2",
                "--max-steps",
                "24",
                "--unattended",
                "--log-dir",
                str(tmp_path),
                "--no-video",
                "--timeout-s",
                "20",
                "--gripper-timeout-s",
                str(SIM_GRIPPER_TIMEOUT_S),
            ]  # fmt: skip
        )
    assert code == 0, capsys.readouterr()
    summaries = json.loads((tmp_path / "session_summary.json").read_text())
    assert [s["status"] for s in summaries] == ["completed", "completed"]
    ids = [s["session_id"] for s in summaries]
    assert ids[0] != ids[1]

    # the server saw: 3 chunks for episode 1, the release of its session when episode 2 started, 3 chunks for it
    # (a chunk that came too late to execute on a loaded machine is dropped and asked again: one call more, counted)
    calls = [s["server_calls"] for s in summaries]
    assert [c - s["execution"]["dropped_stale"] for c, s in zip(calls, summaries)] == [3, 3]
    assert server.events == [("infer", ids[0])] * calls[0] + [("reset", ids[0])] + [("infer", ids[1])] * calls[1]

    cfg = SafetyConfig()
    for index in range(2):
        steps = _steps(tmp_path / f"episode_{index:04d}")
        assert len(steps) == 24
        commands = np.array([s["command"] for s in steps])
        measured = np.array([s["joint_position"] for s in steps])
        assert np.all(commands >= cfg.lower - 1e-9) and np.all(commands <= cfg.upper + 1e-9)
        assert np.all(np.abs(np.diff(commands, axis=0)) <= cfg.step_limit + 1e-9)
        assert np.all(measured >= cfg.joint_lower) and np.all(measured <= cfg.joint_upper)
        # the arm really followed the sway of joint 0 that the fake server asked for
        assert np.ptp(measured[:, 0]) > 0.01
        assert np.max(np.abs(measured - commands)) < 0.2
        # the gripper closed on the second chunk (odd calls close)
        assert max(s["gripper_position"] for s in steps) > 0.5 and steps[0]["gripper_position"] < 0.1


def test_server_killed_mid_episode_holds_the_real_arm(franky_sim, tmp_path):
    from dreamzero_droid.droid import CAMERAS
    from dreamzero_droid.links import OpenPILink
    from dreamzero_droid.policy import DroidPolicy
    from dreamzero_franka.common.kinematics import tcp_position
    from dreamzero_franka.common.loop import LoopConfig
    from dreamzero_franka.common.sim_backends import SyntheticCamera
    from dreamzero_franka.droid.loop import DroidEpisodeRunner
    from dreamzero_franka.franky_backend import FrankyConfig, FrankyGripper, FrankyRobot

    config = FrankyConfig(franky_sim, realtime=False)
    cameras = {name: SyntheticCamera(name) for name in CAMERAS}
    with FakeOpenPIServer(kill_after_infers=3) as server:
        link = OpenPILink(server.url, timeout_s=5.0, max_reconnects=1)
        with FrankyRobot(config) as robot, FrankyGripper(config) as gripper:
            for cam in cameras.values():
                cam.connect()
            runner = DroidEpisodeRunner(
                robot, gripper, cameras, DroidPolicy(link, "stack the blocks", session_prefix="franka"),
                config=LoopConfig(max_steps=60, log_dir=str(tmp_path), record_video=False,
                                  gripper_timeout_s=SIM_GRIPPER_TIMEOUT_S),
            )  # fmt: skip
            result = runner.run_episode(0)
            assert result.status == "failed"
            assert result.reason.startswith("server_unreachable"), result.reason
            assert result.server_calls == 2 and result.steps == 16

            # the arm holds: it settles, then stays put (the simulator's velocity estimate is too noisy to use)
            time.sleep(1.0)
            samples = []
            for _ in range(10):
                samples.append(robot.observe().joint_positions)
                time.sleep(0.05)
            assert np.max(np.ptp(np.array(samples), axis=0)) < 2e-3
            after = robot.observe()

            # the backend itself refuses targets outside the hardware limits or non-finite ones
            from dreamzero_franka.common.contracts import RobotFault

            for bad in (after.joint_positions + np.array([3.0, 0, 0, 0, 0, 0, 0]), np.full(7, np.nan)):
                with pytest.raises(RobotFault):
                    robot.send(bad)

            # our forward kinematics agree with the controller's end-effector pose
            pose = robot._robot.current_pose.end_effector_pose.translation
            np.testing.assert_allclose(tcp_position(after.joint_positions), np.asarray(pose), atol=2e-3)
        link.close()
    summary = json.loads((tmp_path / "episode_0000" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith("server_unreachable")


# --- against the live DreamZero server (`serve run serve_config.yaml`, embedded tiny model on CPU) -----------------
@pytest.fixture
def live_server(tiny_server):
    """The e2e tier's shared `serve run` of the embedded tiny model (tests/e2e/conftest.py), as its WebSocket URL."""
    return tiny_server.url.replace("http://", "ws://") + "/v1/realtime/robot/openpi"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_two_episodes_against_the_live_server(franky_sim, live_server, tmp_path):
    from dreamzero_droid.droid import CAMERAS
    from dreamzero_droid.links import OpenPILink
    from dreamzero_droid.policy import DroidPolicy
    from dreamzero_franka.common.loop import LoopConfig
    from dreamzero_franka.common.sim_backends import SyntheticCamera
    from dreamzero_franka.droid.loop import DroidEpisodeRunner
    from dreamzero_franka.franky_backend import FrankyConfig, FrankyGripper, FrankyRobot

    config = FrankyConfig(franky_sim, realtime=False)
    cameras = {name: SyntheticCamera(name) for name in CAMERAS}
    link = OpenPILink(live_server, timeout_s=120.0, max_reconnects=1)
    try:
        assert link.open()["image_resolution"] == [180, 320]
        with FrankyRobot(config) as robot, FrankyGripper(config) as gripper:
            for cam in cameras.values():
                cam.connect()
            runner = DroidEpisodeRunner(
                robot, gripper, cameras, DroidPolicy(link, "put the cube in the bowl", session_prefix="franka"),
                config=LoopConfig(max_steps=16, log_dir=str(tmp_path), record_video=False, chunk_wait_s=120.0,
                                  gripper_timeout_s=SIM_GRIPPER_TIMEOUT_S),
            )  # fmt: skip
            results = runner.run(episodes=2)
    finally:
        link.close()
    assert [r.status for r in results] == ["completed", "completed"], [r.reason for r in results]
    # what the server reported for each chunk: the second episode's session restarted fresh at step 1
    reports = []
    for index, result in enumerate(results):
        steps = _steps(tmp_path / f"episode_{index:04d}")
        queried = [s["server"] for s in steps if s["queried"]]  # the session report of each chunk
        assert len(queried) == 2
        assert all(r["session_id"].endswith(":" + result.session_id) for r in queried)
        reports.append(queried)
        # the tiny model's actions are meaningless, but every command stayed inside the limits
        commands = np.array([s["command"] for s in steps])
        assert np.all(np.isfinite(commands)) and len(commands) == 16
    for queried in reports:
        assert [r["step"] for r in queried] == [1, 2]
        assert queried[0]["restarted"] and queried[0]["restart_reason"] in ("new_session", "reset_requested")
        assert not queried[1]["restarted"]
    assert results[0].session_id != results[1].session_id


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_http_transport_against_the_live_server(live_server, tmp_path):
    """The same loop over `POST /v1/actions/generations` (raw form), on the simulated arm."""
    from dreamzero_franka.cli import main

    http_url = live_server.split("/v1/")[0].replace("ws://", "http://")
    code = main(
        ["--server", http_url, "--prompt", "put the cube in the bowl", "--robot", "sim", "--cameras", "synthetic",
         "--unattended", "--no-video", "--max-steps", "16", "--log-dir", str(tmp_path), "--timeout-s", "120"]
    )  # fmt: skip
    assert code == 0
    steps = _steps(tmp_path / "episode_0000")
    sessions = [s["server"] for s in steps if s["queried"]]
    assert [r["step"] for r in sessions] == [1, 2]
    assert np.all(np.isfinite([s["command"] for s in steps]))
