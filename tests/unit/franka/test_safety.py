"""Safety layer: limits, per-step bound, workspace box (forward kinematics), watchdog (chunk checks: the runtime)."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero.errors import ConfigError
from dreamzero_droid.policy import ChunkRejected
from dreamzero_franka.common.guards import Watchdog
from dreamzero_franka.common.kinematics import flange_pose, tcp_position
from dreamzero_franka.common.limits import DROID_HOME
from dreamzero_franka.droid.safety import SafetyConfig, SafetyFilter

EPS = 1e-9


def test_fk_home_pose_matches_droid_reference():
    # DROID's documented TCP at home: about (0.360, 0.0, 0.387) m
    np.testing.assert_allclose(tcp_position(DROID_HOME), [0.360, 0.0, 0.387], atol=2e-3)
    pose = flange_pose(DROID_HOME)
    np.testing.assert_allclose(pose[:3, :3] @ pose[:3, :3].T, np.eye(3), atol=1e-12)
    # at home the gripper points straight down
    np.testing.assert_allclose(pose[:3, 2], [0, 0, -1], atol=1e-9)


def test_fk_zero_pose_is_the_stacked_link_lengths():
    # all joints at zero: the arm is straight up except the 0.088 m offset of joint 7 and the 0.0825 elbow offsets
    p = flange_pose(np.zeros(7))[:3, 3]
    np.testing.assert_allclose(p, [0.088, 0.0, 0.333 + 0.316 + 0.384 - 0.107], atol=1e-9)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"joint_margin_rad": -0.1}, "joint_margin_rad"),
        ({"max_step_rad": 0.0}, "max_step_rad"),
        ({"joint_lower": np.zeros(6)}, "joint_lower"),
        ({"workspace_min": (0, 0, 0)}, "workspace_min"),
        ({"workspace_min": (0, 0, 0), "workspace_max": (1, -1, 1)}, "workspace_min"),
        ({"gripper_threshold": 1.5}, "gripper_threshold"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SafetyConfig(**kwargs)


def test_step_limit_is_the_tighter_of_step_and_velocity_cap():
    cfg = SafetyConfig()
    # 2.075 rad/s / 15 Hz = 0.138 rad (joints 1-4), 2.51 / 15 = 0.167 (joints 5-7), both under 0.2
    np.testing.assert_allclose(cfg.step_limit, [2.075 / 15] * 4 + [2.51 / 15] * 3)
    assert np.all(SafetyConfig(max_step_rad=0.05).step_limit == 0.05)


def _assert_within(cfg: SafetyConfig, commands: np.ndarray, start: np.ndarray) -> None:
    assert np.all(commands >= cfg.lower - EPS) and np.all(commands <= cfg.upper + EPS)
    deltas = np.abs(np.diff(np.vstack([start, commands]), axis=0))
    assert np.all(deltas <= cfg.step_limit + EPS), deltas.max(axis=0)


def test_adversarial_targets_never_leave_limits():
    rng = np.random.default_rng(0)
    cfg = SafetyConfig()
    filt = SafetyFilter(cfg)
    q = DROID_HOME.copy()
    commands = []
    for i in range(400):
        kind = i % 4
        if kind == 0:  # jumps of a radian
            target = q + rng.choice([-1.0, 1.0], size=7)
        elif kind == 1:  # far outside the limits
            target = rng.uniform(-10, 10, size=7)
        elif kind == 2:  # just past a limit
            target = np.where(rng.random(7) < 0.5, cfg.joint_upper + 0.05, cfg.joint_lower - 0.05)
        else:
            target = q + rng.normal(0, 0.05, size=7)
        cmd = filt.filter(target, measured=q)
        commands.append(cmd.joint_targets)
        q = cmd.joint_targets  # a perfectly tracking arm
    _assert_within(cfg, np.array(commands), DROID_HOME)


def test_clamp_reasons_are_reported():
    filt = SafetyFilter()
    cmd = filt.filter(DROID_HOME + 1.0, measured=DROID_HOME)
    assert "step_limit" in cmd.clamped
    filt.reset()
    cmd = filt.filter(np.full(7, 50.0), measured=DROID_HOME)
    assert cmd.clamped == ("joint_limit", "step_limit")
    filt.reset()
    assert filt.filter(DROID_HOME, measured=DROID_HOME).clamped == ()


def test_non_finite_target_is_rejected():
    with pytest.raises(ChunkRejected):
        SafetyFilter().filter(np.full(7, np.nan), measured=DROID_HOME)


def test_joint_outside_limits_may_only_move_back():
    cfg = SafetyConfig()
    q = DROID_HOME.copy()
    q[3] = cfg.joint_upper[3] - 0.02  # inside the hardware limit, outside the margin
    cmd = SafetyFilter(cfg).filter(q + np.array([0, 0, 0, 0.5, 0, 0, 0]), measured=q)
    assert cmd.joint_targets[3] <= q[3] + EPS  # not further out
    cmd = SafetyFilter(cfg).filter(q - np.array([0, 0, 0, 0.5, 0, 0, 0]), measured=q)
    assert cmd.joint_targets[3] == pytest.approx(q[3] - cfg.step_limit[3])  # back in, one step at a time


def test_workspace_box_shortens_steps_that_leave_it():
    # box whose floor sits 1 cm under the home TCP: moving down must stop at the floor
    home_tcp = tcp_position(DROID_HOME)
    cfg = SafetyConfig(workspace_min=(0.2, -0.3, home_tcp[2] - 0.01), workspace_max=(0.7, 0.3, 0.8), max_step_rad=0.2)
    filt = SafetyFilter(cfg)
    q = DROID_HOME.copy()
    down = DROID_HOME + np.array([0, 0.3, 0, 0, 0, 0, 0])  # shoulder forward: lowers the TCP by ~11 cm
    assert tcp_position(down)[2] < home_tcp[2] - 0.05
    clamped_any = False
    for _ in range(20):
        cmd = filt.filter(down, measured=q)
        clamped_any |= "workspace" in cmd.clamped
        q = cmd.joint_targets
        assert filt.workspace_violation(q) <= 1e-6
    assert clamped_any
    assert tcp_position(q)[2] == pytest.approx(home_tcp[2] - 0.01, abs=2e-3)


def test_workspace_start_outside_may_not_go_further_out():
    home_tcp = tcp_position(DROID_HOME)
    cfg = SafetyConfig(workspace_min=(0.5, -0.3, 0.1), workspace_max=(0.8, 0.3, 0.8))  # home is 0.14 m behind it
    filt = SafetyFilter(cfg)
    start = filt.workspace_violation(DROID_HOME)
    assert start == pytest.approx(0.5 - home_tcp[0], abs=1e-6)
    backwards = DROID_HOME + np.array([0, -0.2, 0, -0.2, 0, 0, 0])
    cmd = filt.filter(backwards, measured=DROID_HOME)
    assert filt.workspace_violation(cmd.joint_targets) <= start + 1e-6


def test_watchdog_fires_once_per_silence_and_rearms():
    now = [0.0]
    fired = []
    dog = Watchdog(0.5, on_expire=lambda: fired.append(now[0]), clock=lambda: now[0])
    dog.feed()
    now[0] = 0.4
    assert not dog.check()
    now[0] = 0.6
    assert dog.check() and fired == [0.6]
    now[0] = 2.0
    assert not dog.check()  # still silent: no repeated holds
    dog.feed()
    now[0] = 2.7
    assert dog.check() and dog.expirations == 2


def test_watchdog_thread_holds_a_blocked_loop():
    import threading

    held = threading.Event()
    with Watchdog(0.05, on_expire=held.set):
        assert held.wait(timeout=2.0)
    with pytest.raises(ConfigError):
        Watchdog(0, on_expire=lambda: None)
