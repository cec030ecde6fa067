"""franka_pnp safety filter: chunk rejection, workspace / step / lead / joint limits, hold, and a fuzz over chunks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dreamzero_client.errors import ConfigError
from dreamzero_franka.pnp.actions import PnpActionSpace
from dreamzero_franka.pnp.arm_model import pose_error, tcp_pose
from dreamzero_franka.pnp.cartesian import SimCartesianRobot
from dreamzero_franka.pnp.rotations import matrix_to_euler_xyz, rotation_angle, wrap_to_pi
from dreamzero_franka.pnp.safety import (
    PnpChunkRejected,
    PnpSafetyConfig,
    PnpSafetyFilter,
    command_violations,
)
from tests.support.franka_pnp import joints_for, task_poses

POSES = task_poses()
TOL = 1e-6


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Rig:
    robot: SimCartesianRobot
    clock: Clock
    filt: PnpSafetyFilter
    ref: tuple | None = None  # (pose, joints) of the last command; None after a hold (the filter's own rule)


def rig(config: PnpSafetyConfig | None = None, initial=None, velocity=None, poses=POSES) -> Rig:
    clock = Clock()
    robot = SimCartesianRobot(initial=poses.home_joints if initial is None else initial, velocity=velocity, clock=clock)
    robot.connect()
    return Rig(robot, clock, PnpSafetyFilter(poses, PnpActionSpace(), config))


def check_independently(cmd, ref_pose, ref_q, measured, cfg: PnpSafetyConfig, poses=POSES):
    """The limits, recomputed here without the filter's helpers (except the kinematics under test elsewhere)."""
    p = cmd.pose[:3, 3]
    lo, hi = np.minimum(poses.workspace_min, ref_pose[:3, 3]), np.maximum(poses.workspace_max, ref_pose[:3, 3])
    assert np.all(p >= lo - TOL) and np.all(p <= hi + TOL), "outside the workspace box"
    off = wrap_to_pi(matrix_to_euler_xyz(cmd.pose[:3, :3]) - poses.target[3:])
    ref_off = wrap_to_pi(matrix_to_euler_xyz(ref_pose[:3, :3]) - poses.target[3:])
    assert np.all(off >= np.minimum(poses.rotation_below, ref_off) - TOL), "below the rotation window"
    assert np.all(off <= np.maximum(poses.rotation_above, ref_off) + TOL), "above the rotation window"
    assert np.linalg.norm(p - ref_pose[:3, 3]) <= min(cfg.max_step_m, cfg.max_speed_m_s / cfg.control_hz) + TOL
    assert rotation_angle(cmd.pose[:3, :3] @ ref_pose[:3, :3].T) <= cfg.step_rad + TOL
    assert np.linalg.norm(p - measured[:3, 3]) <= cfg.max_lead_m + TOL
    q = cmd.joints
    assert np.all(q >= cfg.joint_lower + cfg.joint_margin_rad - TOL), "joint below its limit"
    assert np.all(q <= cfg.joint_upper - cfg.joint_margin_rad + TOL), "joint above its limit"
    assert np.all(np.abs(q - ref_q) <= cfg.max_joint_velocity / cfg.control_hz + TOL), "joint too fast"
    err = pose_error(cmd.pose, tcp_pose(q))
    assert np.linalg.norm(err[:3]) <= cfg.ik_tol_m + TOL and np.linalg.norm(err[3:]) <= cfg.ik_tol_rad + TOL


def execute(r: Rig, chunk) -> list:
    """What a control loop does with one chunk; returns the commands after checking each one independently."""
    cfg = r.filt.config
    tcp = r.robot.observe_tcp()
    try:
        rows = r.filt.check_chunk(chunk, tcp)
    except PnpChunkRejected:
        r.robot.hold()
        r.filt.reset()
        r.ref = None
        return []
    commands = []
    for row in rows:
        tcp = r.robot.observe_tcp()
        ref_pose, ref_q = (tcp.pose, tcp.joint_positions) if r.ref is None else r.ref
        cmd = r.filt.step(row, tcp)
        if cmd.hold:
            r.robot.hold()
            r.ref = None
        else:
            check_independently(cmd, ref_pose, ref_q, tcp.pose, cfg)
            assert command_violations(cmd.pose, cmd.joints, ref_pose, ref_q, tcp.pose, POSES, cfg) == []
            r.robot.send_pose(cmd.pose, cmd.joints)
            r.ref = (cmd.pose, cmd.joints)
        commands.append(cmd)
        r.clock.t += 1.0 / cfg.control_hz
    return commands


def rows(*motion, n=1, gripper=0.0):
    out = np.zeros((n, 7))
    out[:, : len(motion)] = motion
    out[:, 6] = gripper
    return out


# -- chunk validation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chunk, message",
    [
        ([[0.0] * 7], "numpy array"),
        (np.array([["a"] * 7]), "real numeric"),
        (np.zeros((3, 8)), r"shape \(H >= 1, 7\)"),
        (np.zeros((0, 7)), r"shape \(H >= 1, 7\)"),
        (np.zeros(7), r"shape \(H >= 1, 7\)"),
        (np.array([[0, 0, np.nan, 0, 0, 0, 1.0]]), r"non-finite values \(first at row 0, column 2\)"),
        (np.array([[0, 0, 0, 0, 0, np.inf, 1.0]]), "non-finite"),
        (np.array([[0, 0, 0, 2.0, 0, 0, 1.0]]), r"actions\[0, 3\] = 2 is beyond"),
        (rows(0, 0, 1, n=12), "jump"),  # 36 cm down from 10 cm above the box floor
    ],
)
def test_bad_chunks_are_rejected_whole(chunk, message):
    r = rig()
    with pytest.raises(PnpChunkRejected, match=message):
        r.filt.check_chunk(chunk, r.robot.observe_tcp())
    assert execute(r, chunk) == [] and r.robot.holding and r.robot.pose_commands == []


def test_expected_rows_is_enforced():
    r = rig(PnpSafetyConfig(expected_rows=12))
    with pytest.raises(PnpChunkRejected, match="12 rows"):
        r.filt.check_chunk(rows(n=24), r.robot.observe_tcp())


def test_a_bad_row_or_pose_is_refused():
    r = rig()
    with pytest.raises(PnpChunkRejected, match="finite"):
        r.filt.step(np.array([0, 0, 0, np.nan, 0, 0, 1.0]), r.robot.observe_tcp())
    with pytest.raises(PnpChunkRejected, match="7 finite"):
        r.filt.step(np.zeros(8), r.robot.observe_tcp())
    with pytest.raises(PnpChunkRejected, match="4x4"):
        r.filt.step_to_pose(np.eye(3), r.robot.observe_tcp())
    assert r.robot.pose_commands == []


# -- per-step limits ---------------------------------------------------------------------------------------------------


def test_workspace_floor_is_never_crossed():
    r = rig()
    commands = execute(r, rows(0, 0, 1, n=6))  # TCP z points down: 18 cm towards a floor 10 cm below
    assert all(not c.hold for c in commands)
    z = [c.pose[2, 3] for c in commands]
    assert min(z) >= POSES.workspace_min[2] - TOL
    assert z[-1] == pytest.approx(POSES.workspace_min[2], abs=1e-6)
    assert "workspace" in commands[-1].clamped


def test_step_is_capped_by_the_speed_limit():
    cfg = PnpSafetyConfig(max_speed_m_s=0.1)  # 1 cm per step at 10 Hz
    commands = execute(rig(cfg), rows(1, n=3))
    start = rig().robot.observe_tcp().pose[:3, 3]
    # each step starts from the measured pose, which the simulated arm reaches to its IK tolerance (1 mm)
    np.testing.assert_allclose([c.pose[0, 3] - start[0] for c in commands], [0.01, 0.02, 0.03], atol=1e-3)
    assert all("step_limit" in c.clamped for c in commands)


def test_yaw_stops_at_the_rotation_window():
    commands = execute(rig(), rows(0, 0, 0, 0, 0, 1, n=8))  # 0.1 rad per step; the window allows pi/6
    yaw = [wrap_to_pi(matrix_to_euler_xyz(c.pose[:3, :3])[2] - POSES.target[5]) for c in commands]
    assert max(np.abs(yaw)) <= np.pi / 6 + TOL
    assert abs(yaw[-1]) == pytest.approx(np.pi / 6, abs=1e-6)
    assert "rotation_window" in commands[-1].clamped


def test_a_stuck_arm_gets_no_runaway_target():
    r = rig(velocity=np.zeros(7))  # the simulated arm never moves
    start = r.robot.observe_tcp().pose[:3, 3]
    commands = execute(r, rows(1, n=4))
    # targets are relative to the measured pose, so they stay one step ahead of the stuck arm
    assert all(np.linalg.norm(c.pose[:3, 3] - start) <= 0.03 + 1e-9 for c in commands if not c.hold)


def test_an_arm_pushed_away_from_the_last_command_makes_the_filter_hold():
    r = rig()
    tcp = r.robot.observe_tcp()
    first = r.filt.step(rows(1)[0], tcp)
    assert not first.hold
    pushed = POSES.reset + np.array([-0.09, 0.14, 0.0, 0, 0, 0])  # 17 cm away, as after a collision
    r.robot.move_to(joints_for(pushed, seed=POSES.home_joints), timeout_s=1.0)
    held = r.filt.step(rows(1)[0], r.robot.observe_tcp())
    assert held.hold and held.pose is None and "shortened" in held.clamped
    # after the hold the filter starts again from the measured pose
    again = r.filt.step(rows(1)[0], r.robot.observe_tcp())
    assert not again.hold
    assert np.linalg.norm(again.pose[:3, 3] - r.robot.observe_tcp().pose[:3, 3]) <= 0.03 + 1e-9


def test_joint_limits_shorten_then_hold():
    home = POSES.home_joints
    # pretend the FR3 limits sit 0.15 rad around the current configuration (0.05 rad usable after the margin)
    cfg = PnpSafetyConfig(joint_lower=home - 0.15, joint_upper=home + 0.15, joint_margin_rad=0.1)
    r = rig(cfg)
    commands = execute(r, rows(1, 0, 0, 0, 0, 0.5, n=4))
    assert any("shortened" in c.clamped for c in commands)
    assert commands[-1].hold
    for c in commands:
        if not c.hold:
            assert np.all(np.abs(c.joints - home) <= 0.05 + TOL)
    assert all(np.all(np.abs(cmd.target - home) <= 0.05 + TOL) for cmd in r.robot.commands if cmd.kind == "send")


def test_gripper_command_passes_through():
    commands = execute(rig(), np.vstack([rows(gripper=-1.0), rows(gripper=1.0), rows(gripper=0.2)]))
    assert [c.gripper_closed for c in commands] == [True, False, None]


def test_command_violations_catches_each_limit():
    r = rig()
    tcp = r.robot.observe_tcp()
    cfg = r.filt.config
    pose, q = tcp.pose.copy(), tcp.joint_positions
    assert command_violations(pose, q, pose, q, pose, POSES, cfg) == []
    far = pose.copy()
    far[0, 3] += 0.05
    assert {"step_translation", "joints_do_not_reach_pose"} <= set(
        command_violations(far, q, pose, q, pose, POSES, cfg)
    )
    low = pose.copy()
    low[2, 3] = POSES.workspace_min[2] - 0.01
    assert "workspace" in command_violations(low, q, pose, q, pose, POSES, cfg)
    bent = q.copy()
    bent[3] = cfg.joint_upper[3]
    assert "joint_limit" in command_violations(pose, bent, pose, q, pose, POSES, cfg)


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="pnp_safety.max_step_m"):
        PnpSafetyConfig(max_step_m=-1)
    with pytest.raises(ConfigError, match="metres"):
        PnpSafetyConfig(max_step_m=3.0)
    with pytest.raises(ConfigError, match="max_abs_action"):
        PnpSafetyConfig(max_abs_action=0.5)
    with pytest.raises(ConfigError, match="control_hz"):
        PnpSafetyFilter(POSES, PnpActionSpace(control_hz=15.0), PnpSafetyConfig(control_hz=10.0))


# -- fuzz --------------------------------------------------------------------------------------------------------------

_in_range = st.floats(-1.2, 1.2)  # a little past the action range, as a policy may overshoot
_dirty = st.one_of(_in_range, st.sampled_from([1.5, -1.5, 3.0, -40.0, float("nan"), float("inf"), float("-inf")]))
_clean_chunks = arrays(np.float64, st.tuples(st.integers(1, 10), st.just(7)), elements=_in_range)
_bad_chunks = st.one_of(
    arrays(np.float64, st.tuples(st.integers(1, 10), st.just(7)), elements=_dirty),
    arrays(np.float64, st.tuples(st.integers(0, 3), st.sampled_from([6, 8])), elements=_in_range),
    arrays(np.float32, st.tuples(st.integers(1, 4), st.just(7)), elements=st.floats(-1, 1, width=32)),
)
# start anywhere in the box (below the reset height) with a yaw inside the window
_starts = st.tuples(st.floats(-0.09, 0.09), st.floats(-0.14, 0.14), st.floats(-0.09, 0.0), st.floats(-0.5, 0.5))


def _run_fuzz(chunks, start) -> Rig:
    dx, dy, dz, yaw = start
    reset = POSES.reset + np.array([dx, dy, dz, 0.0, 0.0, yaw])
    r = rig(initial=joints_for(reset, seed=POSES.home_joints))
    for chunk in chunks:
        execute(r, chunk)  # every command is checked inside, independently of the filter
    cfg = r.filt.config
    # after a hold the filter starts from the measured pose, which the simulated controller reaches only within its
    # IK tolerance: a reference that far outside the box may stay there (never go further out), so allow that much
    box_tol = cfg.ik_tol_m + TOL
    for sent in r.robot.pose_commands:
        p = sent[:3, 3]
        assert np.all(p >= POSES.workspace_min - box_tol) and np.all(p <= POSES.workspace_max + box_tol)
    for cmd in r.robot.commands:
        if cmd.kind == "send":
            assert np.all(cmd.target >= cfg.lower - TOL) and np.all(cmd.target <= cfg.upper + TOL)
    return r


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(_clean_chunks, min_size=1, max_size=3), start=_starts)
def test_fuzzed_chunks_never_produce_a_command_outside_the_limits(chunks, start):
    r = _run_fuzz(chunks, start)
    event(f"commands sent: {'some' if r.robot.pose_commands else 'none'}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.one_of(_clean_chunks, _bad_chunks), min_size=1, max_size=4), start=_starts)
def test_fuzzed_bad_chunks_are_held_and_never_reach_the_arm(chunks, start):
    r = _run_fuzz(chunks, start)
    # a chunk with a non-finite or far out-of-range value, or the wrong shape, never produced a pose command
    good_rows = 0
    for chunk in chunks:
        ok = chunk.ndim == 2 and chunk.shape[1] == 7 and len(chunk) and np.all(np.abs(chunk) <= 1.5)
        good_rows += len(chunk) if ok else 0
    assert len(r.robot.pose_commands) <= good_rows


def test_the_fuzz_is_not_vacuous():
    # the clean strategy's typical chunk is executed: commands reach the arm and stay inside the limits
    rng = np.random.default_rng(1)
    r = _run_fuzz([rng.uniform(-1, 1, (8, 7)) for _ in range(3)], (0.0, 0.0, -0.05, 0.0))
    assert len(r.robot.pose_commands) >= 12
