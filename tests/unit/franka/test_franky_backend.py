"""franky backend against a stand-in `franky` module: what it asks libfranka to do, and how it maps errors.

The real library is exercised against franky-sim in tests/e2e/test_franka_franky_sim.py; this test pins down the
calls (realtime config, dynamics factors, stop motion, one gripper command at a time) without a simulator.
"""

from __future__ import annotations

import sys
import threading
import time
import types

import numpy as np
import pytest

from dreamzero.errors import ConfigError
from dreamzero_franka.common.contracts import DeviceError, RobotFault
from dreamzero_franka.common.limits import DROID_HOME
from dreamzero_franka.franky_backend import FrankyConfig, FrankyGripper, FrankyRobot


def _fake_franky(calls: list, fail_move: list):
    franky = types.ModuleType("franky")

    class FrankyException(Exception):
        pass

    class GripperException(Exception):
        pass

    franky.Exception, franky.GripperException = FrankyException, GripperException
    franky.RealtimeConfig = types.SimpleNamespace(Enforce="Enforce", Ignore="Ignore")
    franky.RelativeDynamicsFactor = lambda *a: ("rdf", a)
    franky.JointState = lambda q: ("state", tuple(q))
    franky.JointMotion = lambda target, relative_dynamics_factor, return_when_finished: (
        "joint",
        target,
        relative_dynamics_factor,
        return_when_finished,
    )
    franky.JointStopMotion = lambda: ("stop",)

    class Robot:
        def __init__(self, host, **kwargs):
            calls.append(("robot", host, kwargs))
            self.current_joint_state = types.SimpleNamespace(position=list(DROID_HOME), velocity=[0.0] * 7)

        def recover_from_errors(self):
            calls.append(("recover",))
            return True

        def move(self, motion, asynchronous=False):
            if fail_move:
                raise FrankyException(fail_move.pop())
            calls.append(("move", motion, asynchronous))

        def join_motion(self, timeout=None):
            calls.append(("join", timeout))
            return True

    class Gripper:
        in_flight = 0
        max_overlap = 0
        duration_s = 0.05  # a command takes a while

        def __init__(self, host):
            self.max_width, self.width = 0.08, 0.08
            self._lock = threading.Lock()

        def _command(self, name, width):
            with self._lock:
                Gripper.in_flight += 1
                Gripper.max_overlap = max(Gripper.max_overlap, Gripper.in_flight)
            calls.append(("gripper", name))
            time.sleep(Gripper.duration_s)
            self.width = width
            with self._lock:
                Gripper.in_flight -= 1
            return True

        def grasp(self, width, speed, force, epsilon_inner, epsilon_outer):
            assert epsilon_outer == self.max_width  # any object width counts as grasped
            return self._command("grasp", 0.0)

        def move(self, width, speed):
            return self._command("move", width)

    franky.Robot, franky.Gripper = Robot, Gripper
    return franky


@pytest.fixture
def fake(monkeypatch):
    calls: list = []
    fail_move: list = []
    module = _fake_franky(calls, fail_move)
    monkeypatch.setitem(sys.modules, "franky", module)
    return types.SimpleNamespace(calls=calls, fail_move=fail_move, module=module)


def test_robot_streams_joint_motions_and_holds_with_a_stop_motion(fake):
    robot = FrankyRobot(FrankyConfig("10.0.0.2", realtime=False, dynamics=(0.4, 0.1, 0.1)))
    with robot:
        host, kwargs = fake.calls[0][1:]
        assert host == "10.0.0.2" and kwargs["realtime_config"] == "Ignore"
        np.testing.assert_allclose(robot.observe().joint_positions, DROID_HOME)
        robot.send(DROID_HOME + 0.01)
        kind, target, rdf, keep_going = fake.calls[-1][1]
        assert fake.calls[-1][2] is True  # asynchronous
        assert kind == "joint" and rdf == ("rdf", (0.4, 0.1, 0.1)) and keep_going is False
        np.testing.assert_allclose(target[1], DROID_HOME + 0.01)
        robot.move_to(DROID_HOME, timeout_s=5)
        home_motion, join = fake.calls[-2][1], fake.calls[-1]
        assert home_motion[2] == ("rdf", (0.2,)) and home_motion[3] is True and join == ("join", 5)
        robot.hold()
        assert fake.calls[-1][1] == ("stop",)
        with pytest.raises(RobotFault, match="outside the FR3 limits"):
            robot.send(np.full(7, 3.5))
        fake.fail_move.append("joint_velocity_violation reflex")
        with pytest.raises(RobotFault, match="joint_velocity_violation"):
            robot.send(DROID_HOME)
    assert ("move", ("stop",), True) in fake.calls  # disconnect holds
    assert FrankyRobot(FrankyConfig("h")).config.realtime  # realtime is the default


def test_gripper_runs_one_command_at_a_time_and_the_latest_wish_wins(fake):
    gripper = FrankyGripper(FrankyConfig("10.0.0.2"))
    with gripper:
        gripper.open(timeout_s=2)
        assert gripper.observe() == pytest.approx(0.0)
        start = time.monotonic()
        for closed in (True, False, True, False, True):  # faster than the gripper can follow
            gripper.send(closed)
        assert time.monotonic() - start < 0.05  # send never waits for the gripper
        deadline = time.monotonic() + 2
        while gripper.observe() < 0.99 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gripper.observe() == pytest.approx(1.0)  # ends in the last wanted state (closed)
    assert fake.module.Gripper.max_overlap == 1
    commands = [c[1] for c in fake.calls if c[0] == "gripper"]
    assert commands[0] == "move" and commands[-1] == "grasp" and len(commands) <= 4


def test_config_is_validated():
    with pytest.raises(ConfigError, match="franky.host"):
        FrankyConfig("")
    with pytest.raises(ConfigError, match="franky.dynamics"):
        FrankyConfig("h", dynamics=(0.5, 0.0, 0.1))
    with pytest.raises(ConfigError, match="gripper_force_n"):
        FrankyConfig("h", gripper_force_n=500)


def test_unreachable_robot_is_a_device_error(fake, monkeypatch):
    def refuse(host, **kwargs):
        raise fake.module.Exception("Connection refused")

    monkeypatch.setattr(fake.module, "Robot", refuse)
    with pytest.raises(DeviceError, match="cannot connect to the robot at 10.0.0.9"):
        FrankyRobot(FrankyConfig("10.0.0.9")).connect()


def test_open_waits_for_a_running_grasp_then_bounds_the_open_itself(fake):
    """The open's bound starts when the open starts: a grasp still running (the last one of an episode) first gets
    its own bound, so a slow gripper (or a simulator behind the wall clock) does not fail the open that follows."""
    gripper = FrankyGripper(FrankyConfig("10.0.0.2"))
    with gripper:
        fake.module.Gripper.duration_s = 0.3
        gripper.send(True)  # a grasp starts...
        deadline = time.monotonic() + 2
        while not gripper._busy and time.monotonic() < deadline:
            time.sleep(0.001)
        start = time.monotonic()
        gripper.open(timeout_s=0.45)  # 0.3 s of grasp + 0.3 s of open: more than one bound, each part within it
        assert time.monotonic() - start > 0.45 and gripper.observe() == pytest.approx(0.0)
        gripper.send(True)
        while not gripper._busy and time.monotonic() < deadline + 2:
            time.sleep(0.001)
        with pytest.raises(DeviceError, match="did not finish its previous command within 0.1 s"):
            gripper.open(timeout_s=0.1)
    commands = [c[1] for c in fake.calls if c[0] == "gripper"]
    assert commands[:3] == ["grasp", "move", "grasp"]


def test_cartesian_robot_reads_the_external_wrench_and_streams_pose_commands(fake):
    from dreamzero_franka.franky_backend import FrankyCartesianRobot
    from dreamzero_franka.pnp.arm_model import tcp_pose

    robot = FrankyCartesianRobot(FrankyConfig("10.0.0.2", realtime=False))
    with robot:
        wrench = [1.0, -2.0, 3.0, 0.1, 0.2, -0.3]
        robot._robot.state = types.SimpleNamespace(K_F_ext_hat_K=wrench)
        tcp = robot.observe_tcp()
        np.testing.assert_allclose(tcp.wrench, wrench)
        np.testing.assert_allclose(tcp.pose, tcp_pose(DROID_HOME))
        np.testing.assert_allclose(tcp.twist, 0.0)
        robot.send_pose(tcp_pose(DROID_HOME + 0.01), DROID_HOME + 0.01)  # the filter's joint solution is streamed
        kind, target, _, _ = fake.calls[-1][1]
        assert kind == "joint"
        np.testing.assert_allclose(target[1], DROID_HOME + 0.01)
        robot._robot.state = types.SimpleNamespace(K_F_ext_hat_K=[np.nan] * 6)
        with pytest.raises(RobotFault, match="external wrench"):
            robot.observe_tcp()
