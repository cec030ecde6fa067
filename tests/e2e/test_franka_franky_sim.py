"""The real franky code path against `franky-sim` (libfranka protocol on loopback, MuJoCo, headless).

franky-sim binds the first free 127.x address on ports 1337 (robot) / 1338 (gripper) and prints it; the fixture
reads it from stdout, and kills the simulator's process group when the module is done. The policy server is a small
fake OpenPI WebSocket server (tests/franka_support.py) that records resets and session ids.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.franka_support import FakeOpenPIServer

franky = pytest.importorskip("franky", reason="franky-control is not installed (pip install 'dreamzero-serve[dev]')")

SIM = shutil.which("franky-sim") or str(Path(sys.executable).parent / "franky-sim")
pytestmark = [
    pytest.mark.skipif(not os.path.exists(SIM), reason="franky-sim is not installed (pip install franky-sim)"),
    pytest.mark.timeout(300),
]

START_TIMEOUT_S = 60.0


def _wait_for_port(host: str, port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"franky-sim did not listen on {host}:{port}")


def _own_group_and_die_with_parent() -> None:
    """Child setup: a new process group (killed as a whole below) that Linux also kills if this test process dies
    without cleaning up (SIGKILL from a timeout, a crash)."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux / glibc: the finally below still cleans up on a normal exit


@pytest.fixture(scope="module")
def franky_sim():
    # unbuffered: franky-sim prints its address through Python's stdout, block-buffered when it is a pipe
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [SIM, "--simulator", "mujoco"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_own_group_and_die_with_parent,
    )
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def pump():  # keep draining stdout so the simulator never blocks on a full pipe
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"using '([\d.]+)' as the robot IP", line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        if not ready.wait(START_TIMEOUT_S) or not found:
            pytest.fail(f"franky-sim did not start (exit {proc.poll()}):\n{''.join(lines)[-3000:]}")
        host = found[0]
        _wait_for_port(host, 1337, deadline)
        _wait_for_port(host, 1338, deadline)
        yield host
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _steps(episode_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (episode_dir / "steps.jsonl").read_text().splitlines()]


def test_two_episodes_through_the_cli_with_a_session_reset_between(franky_sim, tmp_path, capsys):
    from clients.franka.cli import main
    from clients.franka.safety import SafetyConfig

    with FakeOpenPIServer() as server:
        code = main(
            [
                "--server", server.url, "--prompt", "put the cube in the bowl",
                "--robot", "franky", "--robot-ip", franky_sim, "--no-realtime",
                "--cameras", "synthetic", "--episodes", "2", "--max-steps", "24", "--unattended",
                "--log-dir", str(tmp_path), "--no-video", "--timeout-s", "20",
            ]  # fmt: skip
        )
    assert code == 0, capsys.readouterr()
    summaries = json.loads((tmp_path / "session_summary.json").read_text())
    assert [s["status"] for s in summaries] == ["completed", "completed"]
    ids = [s["session_id"] for s in summaries]
    assert ids[0] != ids[1]

    # the server saw: reset(episode 1), 3 chunks for episode 1, reset(episode 2), 3 chunks for episode 2
    assert server.events == [("reset", ids[0])] + [("infer", ids[0])] * 3 + [("reset", ids[1])] + [("infer", ids[1])] * 3

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
        assert max(s["gripper_position"] for s in steps) > 0.5 or any(s["gripper_command"] for s in steps)


def test_server_killed_mid_episode_holds_the_real_arm(franky_sim, tmp_path):
    from clients.franka.franky_backend import FrankyConfig, FrankyGripper, FrankyRobot
    from clients.franka.kinematics import tcp_position
    from clients.franka.loop import EpisodeRunner, LoopConfig
    from clients.franka.policy import DroidPolicy
    from clients.franka.sim_backends import SyntheticCamera
    from clients.openpi_client import OpenPIClient

    config = FrankyConfig(franky_sim, realtime=False)
    cameras = {role: SyntheticCamera(role) for role in ("exterior_0", "exterior_1", "wrist")}
    with FakeOpenPIServer(kill_after_infers=3) as server:
        client = OpenPIClient(server.url, timeout_s=5.0, max_reconnects=1, reconnect_backoff_s=0.2)
        with FrankyRobot(config) as robot, FrankyGripper(config) as gripper:
            for cam in cameras.values():
                cam.connect()
            runner = EpisodeRunner(
                robot, gripper, cameras, DroidPolicy(client, "stack the blocks"),
                config=LoopConfig(max_steps=60, log_dir=str(tmp_path), record_video=False),
            )  # fmt: skip
            result = runner.run_episode(0)
            assert result.status == "failed"
            assert result.reason.startswith("server lost"), result.reason
            assert result.server_calls == 2 and result.steps == 16

            # the arm holds: it settles and then stays put
            time.sleep(1.0)
            before = robot.observe()
            time.sleep(0.5)
            after = robot.observe()
            assert np.max(np.abs(after.joint_positions - before.joint_positions)) < 2e-3
            assert np.max(np.abs(after.joint_velocities)) < 0.02

            # our forward kinematics agree with the controller's end-effector pose
            pose = robot._robot.current_pose.end_effector_pose.translation
            np.testing.assert_allclose(tcp_position(after.joint_positions), np.asarray(pose), atol=2e-3)
        client.close()
    summary = json.loads((tmp_path / "episode_0000" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith("server lost")
