"""Franka FR3 / Panda through franky-control 2.0 (bundles libfranka 0.21; FR3 server protocol 10).

Install: `pip install 'dreamzero-client[franka]'` (or `pip install franky-control`). franky is imported only when a
device connects, so everything else in this package works without it.

How the arm is driven:
- streaming targets: each `send` starts an asynchronous `JointMotion` to the new absolute target, which preempts the
  previous one within the same control mode (joint positions); `return_when_finished=False` keeps the last target
  held, so the 1 kHz loop inside libfranka never stops between our 15 Hz commands. A `RelativeDynamicsFactor`
  (default velocity 0.5, acceleration 0.1, jerk 0.1) keeps the trajectory smooth: faster settings made the stricter
  libfranka simulator hit acceleration-discontinuity reflexes at 15 Hz;
- `move_to` (home) is a blocking `JointMotion` at dynamics factor 0.2;
- `hold` preempts with a `JointStopMotion` (decelerates within the limits and stays);
- errors raised by franky (reflexes, network, invalid operations) become `RobotFault`; `recover()` calls
  `recover_from_errors()`.
Off a PREEMPT_RT kernel libfranka refuses to start unless `realtime=False` (RealtimeConfig.Ignore): fine for tests
and simulators, to be avoided on real hardware (timing violations then abort motions).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from dreamzero_client.errors import ConfigError, MissingDependency
from dreamzero_franka.common.contracts import NUM_JOINTS, ArmState, DeviceError, Gripper, Robot, RobotFault
from dreamzero_franka.common.limits import FR3_JOINT_LOWER, FR3_JOINT_UPPER
from dreamzero_franka.pnp.cartesian import CartesianRobot, franky_external_wrench

INSTALL_HINT = "pip install 'dreamzero-client[franka]'  (or: pip install 'franky-control>=2.0')"


def import_franky():
    try:
        import franky
    except ImportError as exc:
        raise MissingDependency(
            f"the franky backend needs franky-control, which is not installed: {INSTALL_HINT}"
        ) from exc
    return franky


@dataclass
class FrankyConfig:
    host: str  # robot (FCI) address, e.g. 172.16.0.2
    realtime: bool = True  # False -> RealtimeConfig.Ignore (no realtime kernel: simulators, tests)
    dynamics: tuple[float, float, float] = (0.5, 0.1, 0.1)  # velocity / acceleration / jerk factors while streaming
    home_dynamics: float = 0.2
    torque_threshold_nm: float = 20.0  # collision behaviour (franky's defaults)
    force_threshold_n: float = 30.0
    gripper_speed_m_s: float = 0.1
    gripper_force_n: float = 20.0

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("franky.host must name the robot's FCI address (e.g. 172.16.0.2)")
        if len(self.dynamics) != 3 or not all(0 < f <= 1 for f in self.dynamics):
            raise ConfigError(f"franky.dynamics must be three factors in (0, 1], got {self.dynamics}")
        if not 0 < self.home_dynamics <= 1:
            raise ConfigError(f"franky.home_dynamics must be in (0, 1], got {self.home_dynamics}")
        if not 0 < self.gripper_speed_m_s <= 0.2:
            raise ConfigError(f"franky.gripper_speed_m_s must be in (0, 0.2], got {self.gripper_speed_m_s}")
        if not 0 < self.gripper_force_n <= 140:
            raise ConfigError(f"franky.gripper_force_n must be in (0, 140], got {self.gripper_force_n}")


class FrankyRobot(Robot):
    def __init__(self, config: FrankyConfig):
        self.config = config
        self._franky = None
        self._robot = None
        self._lock = (
            threading.Lock()
        )  # franky's Robot is not documented as thread-safe; the watchdog holds from a thread

    def _connect(self) -> None:
        franky = self._franky = import_franky()
        rt = franky.RealtimeConfig.Enforce if self.config.realtime else franky.RealtimeConfig.Ignore
        try:
            self._robot = franky.Robot(
                self.config.host,
                default_torque_threshold=self.config.torque_threshold_nm,
                default_force_threshold=self.config.force_threshold_n,
                realtime_config=rt,
            )
            self._robot.recover_from_errors()
        except franky.Exception as exc:
            raise DeviceError(f"cannot connect to the robot at {self.config.host}: {exc}") from exc
        self._stream_dynamics = franky.RelativeDynamicsFactor(*self.config.dynamics)
        self._home_dynamics = franky.RelativeDynamicsFactor(self.config.home_dynamics)

    def _disconnect(self) -> None:
        try:
            self.hold()
            self._robot.join_motion(2.0)
        except Exception:  # noqa: BLE001 - disconnecting anyway; the arm's controller holds when no motion runs
            pass
        self._robot = None

    def _fault(self, what: str, exc: Exception) -> RobotFault:
        return RobotFault(f"{what}: {type(exc).__name__}: {exc}")

    def observe(self) -> ArmState:
        self._require_connected()
        try:
            state = self._robot.current_joint_state
        except self._franky.Exception as exc:
            raise self._fault("reading the joint state failed", exc) from exc
        return ArmState(
            joint_positions=np.asarray(state.position, dtype=np.float64),
            joint_velocities=np.asarray(state.velocity, dtype=np.float64),
        )

    def _motion(self, q: np.ndarray, dynamics, return_when_finished: bool):
        q = np.asarray(q, dtype=np.float64)
        if q.shape != (NUM_JOINTS,) or not np.all(np.isfinite(q)):
            raise RobotFault(f"joint target must be 7 finite numbers, got {q!r}")
        # last line of defence behind SafetyFilter: never forward a target outside the hardware limits
        outside = (q < FR3_JOINT_LOWER) | (q > FR3_JOINT_UPPER)
        if outside.any():
            raise RobotFault(f"joint target outside the FR3 limits on joints {np.flatnonzero(outside).tolist()}: {q}")
        franky = self._franky
        return franky.JointMotion(
            franky.JointState(q.tolist()), relative_dynamics_factor=dynamics, return_when_finished=return_when_finished
        )

    def send(self, joint_targets: np.ndarray) -> None:
        self._require_connected()
        motion = self._motion(joint_targets, self._stream_dynamics, return_when_finished=False)
        with self._lock:
            try:
                self._robot.move(motion, asynchronous=True)
            except self._franky.Exception as exc:
                raise self._fault("the arm rejected the joint target", exc) from exc

    def move_to(self, joint_positions: np.ndarray, timeout_s: float) -> None:
        self._require_connected()
        motion = self._motion(joint_positions, self._home_dynamics, return_when_finished=True)
        with self._lock:
            try:
                self._robot.move(motion, asynchronous=True)
                finished = self._robot.join_motion(timeout_s)
            except self._franky.Exception as exc:
                raise self._fault("moving home failed", exc) from exc
        if not finished:
            self.hold()
            raise RobotFault(f"moving home did not finish within {timeout_s:.1f} s")

    def hold(self) -> None:
        if self._robot is None:
            return
        with self._lock:
            try:
                self._robot.move(self._franky.JointStopMotion(), asynchronous=True)
            except self._franky.Exception as exc:
                raise self._fault("stopping the arm failed", exc) from exc

    def recover(self) -> bool:
        self._require_connected()
        with self._lock:
            try:
                self._robot.join_motion(0.5)
            except self._franky.Exception:
                pass  # the error that ended the motion is what we are recovering from
            return bool(self._robot.recover_from_errors())


class FrankyCartesianRobot(FrankyRobot, CartesianRobot):
    """FrankyRobot for franka_pnp: TCP state from the measured joints (forward kinematics, J dq) plus libfranka's
    external wrench; a pose command streams the safety filter's joint solution through `send` (the same
    `JointMotion` path and FR3 limit check as DROID)."""

    def external_wrench(self) -> np.ndarray:
        self._require_connected()
        with self._lock:
            try:
                return franky_external_wrench(self._robot)
            except self._franky.Exception as exc:
                raise self._fault("reading the external wrench failed", exc) from exc


class FrankyGripper(Gripper):
    """Franka Hand: binary grasp / open, closure = 1 - width / max_width (DROID's position convention).

    Gripper commands run one at a time in a worker thread: libfranka's gripper deadlocks when a second command is
    issued while one is in flight (seen with franky 2.0 against franky-sim: `move_async` during a `grasp_async`
    never returns). `send` only records the wanted state, so the 15 Hz loop never waits on the gripper; the
    worker always executes the latest wish once the current command is done.
    """

    def __init__(self, config: FrankyConfig):
        self.config = config
        self._franky = None
        self._gripper = None
        self._max_width = 0.08
        self._cond = threading.Condition()
        self._wanted: bool | None = None  # closed?
        self._done: bool | None = None  # state of the last finished command
        self._busy = False
        self._error: str | None = None
        self._stop = False
        self._worker: threading.Thread | None = None

    def _connect(self) -> None:
        franky = self._franky = import_franky()
        try:
            self._gripper = franky.Gripper(self.config.host)
            max_width = float(self._gripper.max_width)
            if max_width <= 0:  # never homed since the fingers were mounted
                self._gripper.homing()
                max_width = float(self._gripper.max_width)
        except (franky.Exception, franky.GripperException) as exc:
            raise DeviceError(f"cannot connect to the gripper at {self.config.host}: {exc}") from exc
        self._max_width = max_width
        self._stop, self._wanted, self._done, self._error = False, None, None, None
        self._worker = threading.Thread(target=self._run, name="franky-gripper", daemon=True)
        self._worker.start()

    def _disconnect(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=10.0)  # lets a running grasp/move finish
        self._worker = None
        self._gripper = None

    def _run(self) -> None:
        cfg = self.config
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or (self._wanted is not None and self._wanted != self._done))
                if self._stop:
                    return
                closed, self._busy = self._wanted, True
            try:
                if closed:
                    # grasp "something": target width 0; any final width between 0 and fully open counts
                    self._gripper.grasp(0.0, cfg.gripper_speed_m_s, cfg.gripper_force_n, 0.005, self._max_width)
                else:
                    self._gripper.move(self._max_width, cfg.gripper_speed_m_s)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported to the loop by the next send / open
                error = f"gripper {'grasp' if closed else 'open'} failed: {type(exc).__name__}: {exc}"
            with self._cond:
                self._busy, self._done, self._error = False, closed, error
                if error is not None:
                    self._wanted = self._done  # do not retry a failing command in a tight loop
                self._cond.notify_all()

    def _raise_pending_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error:
            raise DeviceError(error)

    def observe(self) -> float:
        self._require_connected()
        width = float(self._gripper.width)
        return float(np.clip(1.0 - width / self._max_width, 0.0, 1.0))

    def send(self, closed: bool) -> None:
        self._require_connected()
        self._raise_pending_error()
        with self._cond:
            self._wanted = bool(closed)
            self._cond.notify_all()

    def open(self, timeout_s: float) -> None:
        """Blocking full open. `timeout_s` bounds the open itself: a command still running when this is called
        (the last grasp of an episode) first gets its own `timeout_s` to finish, since commands cannot overlap."""
        self._require_connected()
        self._raise_pending_error()
        with self._cond:
            idle = self._cond.wait_for(lambda: not self._busy, timeout=timeout_s)
            if idle:
                self._wanted, self._done = False, None  # always re-run the open, even if the last command was one
                self._cond.notify_all()
                finished = self._cond.wait_for(lambda: self._done is False and not self._busy, timeout=timeout_s)
        self._raise_pending_error()
        if not idle:
            raise DeviceError(f"the gripper did not finish its previous command within {timeout_s:.1f} s")
        if not finished:
            raise DeviceError(f"the gripper did not open within {timeout_s:.1f} s")
