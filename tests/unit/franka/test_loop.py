"""The deployment loop on simulated devices: sessions, chunk scheduling, safety under adversarial servers, failures."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from dreamzero.errors import ConfigError
from dreamzero_droid.droid import CAMERAS
from dreamzero_franka.common.limits import DROID_HOME
from dreamzero_franka.common.loop import LoopConfig
from dreamzero_franka.common.operator import Command
from dreamzero_franka.common.sim_backends import SimGripper, SimRobot, SyntheticCamera
from dreamzero_franka.droid.safety import SafetyConfig
from tests.support.franka import ScriptedOperator, ScriptedTransport, chunk_near, make_runner

EPS = 1e-9


def assert_commands_within_limits(robot: SimRobot, cfg: SafetyConfig) -> int:
    """Every command that reached the arm is inside the limits and within one step of the previous command."""
    sends = 0
    previous = None
    for cmd in robot.commands:
        if cmd.kind != "send":
            previous = None  # after a hold / home move the next command starts from the measured position
            continue
        sends += 1
        assert np.all(np.isfinite(cmd.target))
        assert np.all(cmd.target >= cfg.lower - EPS) and np.all(cmd.target <= cfg.upper + EPS), cmd.target
        reference = cmd.measured if previous is None else previous
        assert np.all(np.abs(cmd.target - reference) <= cfg.step_limit + 1e-6), cmd.target - reference
        previous = cmd.target
    return sends


def adversarial_reply(obs, i):
    q = np.asarray(obs["observation/joint_position"], np.float64)
    kind = i % 7
    chunk = chunk_near(q, i).astype(np.float64)
    if kind == 0:
        chunk[3:, :7] += 1.0  # a jump of a radian mid-chunk
    elif kind == 1:
        chunk[2, 4] = np.nan
    elif kind == 2:
        chunk[:, :7] = 20.0  # far outside every limit
    elif kind == 3:
        return {"actions": chunk[:, :7]}  # wrong shape
    elif kind == 4:
        chunk[:, 1] = -5.0
        chunk[::2, 5] = 9.0
    elif kind == 5:
        return chunk[:3]  # too short (bare array reply)
    else:
        chunk[:, :7] = q - 1.0  # a radian the other way
        chunk[:, 7] = np.inf
    return {"actions": chunk}


def test_adversarial_chunks_never_reach_the_arm_out_of_limits():
    transport = ScriptedTransport(adversarial_reply)
    runner, robot, gripper = make_runner(transport, max_steps=60, max_rejected_chunks=100, open_loop_horizon=4)
    result = runner.run_episode(0)
    assert result.status == "completed", result.reason
    sends = assert_commands_within_limits(robot, runner.safety.config)
    assert sends > 20
    assert result.rejected_chunks >= 4  # NaN, wrong shape, too short, inf gripper
    assert result.clamps.get("step_limit", 0) > 0 and result.clamps.get("joint_limit", 0) > 0
    assert all(isinstance(c, bool) for c in gripper.commands)


def test_rejected_chunks_in_a_row_fail_the_episode_and_hold():
    transport = ScriptedTransport(lambda obs, i: {"actions": np.full((24, 8), np.nan)})
    runner, robot, _ = make_runner(transport, max_rejected_chunks=3)
    result = runner.run_episode(0)
    assert result.status == "failed"
    assert "3 chunks in a row rejected" in result.reason and "non-finite" in result.reason
    assert not any(c.kind == "send" for c in robot.commands)
    assert robot.holding


def test_server_killed_mid_episode_holds_and_fails_with_reason():
    transport = ScriptedTransport(fail_from=3)
    runner, robot, _ = make_runner(transport, max_steps=200, open_loop_horizon=4)
    result = runner.run_episode(0)
    assert result.status == "failed"
    assert result.reason.startswith("server_unreachable: ConnectionError")
    assert result.server_calls == 3 and result.steps == 12
    assert robot.holding  # the last thing the arm heard was "hold"
    assert_commands_within_limits(robot, runner.safety.config)
    # position did not drift after the hold
    held = robot.commands[-1].target
    time.sleep(0.05)
    np.testing.assert_allclose(robot.observe().joint_positions, held, atol=1e-12)


def test_slow_server_trips_the_watchdog_which_holds_the_arm():
    def reply(obs, i):
        if i == 1:
            time.sleep(0.6)  # twice the watchdog timeout
        return {"actions": chunk_near(obs["observation/joint_position"], i)}

    runner, robot, _ = make_runner(ScriptedTransport(reply), max_steps=20)
    result = runner.run_episode(0)
    assert result.status == "completed"
    kinds = [c.kind for c in robot.commands]
    first_hold = kinds.index("hold")
    assert kinds[first_hold - 1] == "send" and "send" in kinds[first_hold + 1 :]
    assert max(result.latencies_ms) >= 600
    assert_commands_within_limits(robot, runner.safety.config)


def test_each_episode_gets_a_fresh_session_reset_home_and_open_gripper():
    transport = ScriptedTransport()
    runner, robot, gripper = make_runner(transport, max_steps=10)
    results = runner.run(episodes=2)
    assert [r.status for r in results] == ["completed", "completed"]
    assert transport.resets == [results[0].session_id]  # the first session is released when the second starts
    ids = [r.session_id for r in results]
    assert len(set(ids)) == 2 and all(i.startswith("franka-") for i in ids)
    seen = [obs["session_id"] for obs in transport.calls]
    assert seen[0] == ids[0] and seen[-1] == ids[1] and set(seen) == set(ids)
    homes = [c for c in robot.commands if c.kind == "move_to"]
    assert len(homes) == 2
    np.testing.assert_allclose(homes[1].target, DROID_HOME)
    # each episode: 10 steps, horizon 8 -> 2 queries
    assert [r.server_calls for r in results] == [2, 2]
    obs = transport.calls[0]
    assert obs["prompt"] == "put the cube in the bowl"
    assert obs["observation/exterior_image_1_left"].shape == (180, 320, 3)  # 1 frame starts the session
    assert transport.calls[1]["observation/exterior_image_1_left"].shape == (4, 180, 320, 3)
    assert obs["observation/joint_position"].shape == (7,) and obs["observation/gripper_position"].shape == (1,)


def test_chunk_rows_follow_the_open_loop_horizon(tmp_path):
    runner, _, _ = make_runner(ScriptedTransport(), max_steps=20, log_dir=str(tmp_path))
    result = runner.run_episode(0)
    steps = [json.loads(line) for line in (tmp_path / "episode_0000" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 20 == result.steps
    assert [s["queried"] for s in steps].count(True) == 3  # steps 0, 8, 16
    assert [s["chunk_row"] for s in steps] == [*range(8), *range(8), *range(4)]
    summary = json.loads((tmp_path / "episode_0000" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["server_calls"] == 3
    assert summary["mean_latency_ms"] is not None and summary["video"] == "disabled"
    assert len(steps[0]["command"]) == 7 and len(steps[0]["joint_position"]) == 7


def test_prefetch_hides_latency_and_skips_elapsed_rows(tmp_path):
    transport = ScriptedTransport(delay_s=0.02)
    runner, robot, _ = make_runner(
        transport, max_steps=26, prefetch=True, prefetch_lead_steps=5, log_dir=str(tmp_path), watchdog_timeout_s=0.3
    )
    result = runner.run_episode(0)
    assert result.status == "completed"
    steps = [json.loads(line) for line in (tmp_path / "episode_0000" / "steps.jsonl").read_text().splitlines()]
    rows = [s["chunk_row"] for s in steps]
    # first chunk from row 0; every later chunk starts 5 rows in (rows that belong to ticks already executed)
    assert rows[:11] == [*range(8), 5, 6, 7]
    assert result.server_calls == 4
    assert [i for i, s in enumerate(steps) if s["queried"]] == [0, 8, 16, 24]
    # each prefetch went out from the observation 5 ticks before its switch (3, 11, 19): the joint state sent then
    sent = [obs["observation/joint_position"] for obs in transport.calls]
    for call, tick in zip(sent[1:], (3, 11, 19)):
        np.testing.assert_allclose(call, steps[tick]["joint_position"], atol=1e-5)
    kinds = [c.kind for c in robot.commands]
    assert kinds.count("hold") == 1 and kinds[-1] == "hold"  # 20 ms latency (budget 100 ms) never stalled the arm


def test_device_fault_fails_the_episode_and_recovers():
    robot = SimRobot(fail_on_send=5)
    recovered = []
    robot.recover = lambda: recovered.append(True) or True
    runner, robot, _ = make_runner(ScriptedTransport(), robot=robot)
    result = runner.run_episode(0)
    assert result.status == "failed" and "RobotFault" in result.reason and "reflex" in result.reason
    assert recovered and robot.holding


def test_operator_abort_label_and_pause():
    op = ScriptedOperator(at_poll={5: [Command.ABORT]})
    runner, robot, _ = make_runner(ScriptedTransport(), operator=op)
    result = runner.run_episode(0)
    assert (result.status, result.reason, result.steps) == ("aborted", "aborted by the operator", 5)
    assert robot.holding

    op = ScriptedOperator(at_poll={3: [Command.SUCCESS]})
    runner, _, _ = make_runner(ScriptedTransport(), operator=op)
    result = runner.run_episode(0)
    assert (result.status, result.label, result.steps) == ("completed", "success", 3)

    # pause holds the arm until resume; the label is asked at the end
    op = ScriptedOperator(at_poll={2: [Command.PAUSE]}, waits=[Command.RESUME, Command.FAILURE])
    runner, robot, _ = make_runner(ScriptedTransport(), operator=op, max_steps=6)
    result = runner.run_episode(0)
    kinds = [c.kind for c in robot.commands]
    assert kinds[kinds.index("hold") - 1] == "send" and kinds[kinds.index("hold") + 1] == "send"
    assert (result.status, result.label, result.steps) == ("completed", "failure", 6)
    assert any("paused" in p for p in op.prompts)


def test_quit_stops_the_session():
    op = ScriptedOperator(at_poll={2: [Command.QUIT]})
    runner, _, _ = make_runner(ScriptedTransport(), operator=op)
    results = runner.run(episodes=3)
    assert len(results) == 1 and results[0].status == "aborted" and runner.quit_requested


def test_ctrl_c_holds_the_arm_and_ends_the_session():
    class InterruptingCamera(SyntheticCamera):
        def observe(self):
            if self._frames == 6:
                raise KeyboardInterrupt
            return super().observe()

    cameras = {
        "exterior_image_0_left": InterruptingCamera("e0"),
        "exterior_image_1_left": SyntheticCamera("e1"),
        "wrist_image_left": SyntheticCamera("w"),
    }
    runner, robot, _ = make_runner(ScriptedTransport(), cameras=cameras)
    results = runner.run(episodes=2)
    assert len(results) == 1
    assert (results[0].status, results[0].reason) == ("aborted", "interrupted (Ctrl+C)")
    assert robot.holding


def test_server_down_at_episode_start_fails_without_a_policy_command():
    transport = ScriptedTransport(fail_from=0)
    runner, robot, _ = make_runner(transport)
    result = runner.run_episode(0)
    assert result.status == "failed" and result.reason.startswith("server_unreachable")
    kinds = [c.kind for c in robot.commands]
    assert kinds[0] == "move_to" and set(kinds[1:]) == {"hold"}  # home, then hold: no chunk row was sent


def test_video_is_written(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    runner, _, _ = make_runner(ScriptedTransport(), max_steps=8, log_dir=str(tmp_path), record_video=True)
    runner.run_episode(0)
    video = tmp_path / "episode_0000" / "video.mp4"
    assert video.stat().st_size > 1000
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(video))
    meta = next(reader)
    assert tuple(meta["size"]) == (960, 180)
    assert sum(1 for _ in reader) == 8


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"open_loop_horizon": 0}, "open_loop_horizon"),
        ({"prefetch": True, "prefetch_lead_steps": 8}, "prefetch_lead_steps"),
        ({"home": (0.0,) * 6}, "home"),
        ({"watchdog_timeout_s": 0}, "watchdog_timeout_s"),
        ({"control_hz": 0}, "control_hz"),
    ],
)
def test_loop_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LoopConfig(**kwargs)


def test_bad_camera_frame_fails_the_episode_naming_the_camera(tmp_path):
    class GreyCamera(SyntheticCamera):
        def observe(self):
            return super().observe()[..., 0]  # (H, W): not RGB

    cameras = {CAMERAS[0]: SyntheticCamera("e0"), CAMERAS[1]: SyntheticCamera("e1"), CAMERAS[2]: GreyCamera("w")}
    runner, robot, _ = make_runner(ScriptedTransport(), cameras=cameras, log_dir=str(tmp_path))
    result = runner.run_episode(0)
    assert result.status == "failed" and "InvalidObservation" in result.reason and "wrist_image_left" in result.reason
    assert robot.holding


def test_unexpected_errors_hold_the_arm_are_logged_and_propagate(tmp_path):
    class BrokenGripper(SimGripper):
        def observe(self):
            raise ZeroDivisionError("bug")

    runner, robot, _ = make_runner(ScriptedTransport(), log_dir=str(tmp_path))
    runner.gripper = BrokenGripper()
    runner.gripper.connect()
    with pytest.raises(ZeroDivisionError):
        runner.run_episode(0)
    assert robot.holding
    summary = json.loads((tmp_path / "episode_0000" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == "unexpected error: ZeroDivisionError: bug"
