"""Simulated arm, gripper and cameras behind the same contracts as the hardware, for tests and dry runs.

`SimRobot` is kinematic: each joint moves towards its last target at its velocity limit, integrated on the wall
clock, so the loop's timing is exercised for real. It records every command it receives (`commands`), which is what
the safety tests inspect. Faults can be injected (`fail_on_send`) to exercise the error paths.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from dreamzero_franka.common.contracts import NUM_JOINTS, ArmState, Camera, DeviceError, Gripper, Robot, RobotFault
from dreamzero_franka.common.limits import DROID_HOME, FR3_MAX_JOINT_VELOCITY


@dataclass(frozen=True)
class RecordedCommand:
    t: float  # monotonic time of the call
    kind: str  # "send" | "hold" | "move_to"
    target: np.ndarray  # (7,) the target (for "hold": the measured position held)
    measured: np.ndarray  # (7,) the measured position when the command arrived


class SimRobot(Robot):
    def __init__(
        self,
        initial: np.ndarray | None = None,
        velocity: np.ndarray | None = None,
        fail_on_send: int | None = None,
        clock=time.monotonic,
    ):
        self._q = np.array(DROID_HOME if initial is None else initial, dtype=np.float64)
        self._target = self._q.copy()
        self._velocity = np.asarray(FR3_MAX_JOINT_VELOCITY if velocity is None else velocity, dtype=np.float64)
        self._fail_on_send = fail_on_send  # raise RobotFault on the N-th send (1-based)
        self._clock = clock
        self._t = clock()
        self._lock = threading.Lock()
        self.commands: list[RecordedCommand] = []
        self.sends = 0

    def _connect(self) -> None:
        self._t = self._clock()

    def _disconnect(self) -> None:
        pass

    def _advance(self) -> None:
        now = self._clock()
        dt, self._t = max(0.0, now - self._t), now
        self._q += np.clip(self._target - self._q, -self._velocity * dt, self._velocity * dt)

    def observe(self) -> ArmState:
        self._require_connected()
        with self._lock:
            self._advance()
            return ArmState(joint_positions=self._q.copy(), joint_velocities=np.zeros(NUM_JOINTS))

    def send(self, joint_targets: np.ndarray) -> None:
        self._require_connected()
        target = np.asarray(joint_targets, dtype=np.float64)
        if target.shape != (NUM_JOINTS,):
            raise RobotFault(f"joint_targets must have shape (7,), got {target.shape}")
        with self._lock:
            self._advance()
            self.sends += 1
            self.commands.append(RecordedCommand(self._clock(), "send", target.copy(), self._q.copy()))
            if self._fail_on_send is not None and self.sends == self._fail_on_send:
                raise RobotFault("simulated reflex: joint_velocity_violation")
            self._target = target.copy()

    def move_to(self, joint_positions: np.ndarray, timeout_s: float) -> None:
        self._require_connected()
        with self._lock:
            self._advance()
            self.commands.append(
                RecordedCommand(self._clock(), "move_to", np.array(joint_positions, float), self._q.copy())
            )
            self._target = np.array(joint_positions, dtype=np.float64)
            # a real arm takes seconds; the simulation jumps there (tests need not wait)
            self._q = self._target.copy()

    def hold(self) -> None:
        with self._lock:
            self._advance()
            self._target = self._q.copy()
            self.commands.append(RecordedCommand(self._clock(), "hold", self._q.copy(), self._q.copy()))

    @property
    def holding(self) -> bool:
        """True when the last command was a hold (the arm is stopped where it is)."""
        return bool(self.commands) and self.commands[-1].kind == "hold"


class SimGripper(Gripper):
    def __init__(self, speed_per_s: float = 2.0, clock=time.monotonic):
        self._closure = 0.0
        self._target = 0.0
        self._speed = speed_per_s
        self._clock = clock
        self._t = clock()
        self.commands: list[bool] = []

    def _connect(self) -> None:
        self._t = self._clock()

    def _disconnect(self) -> None:
        pass

    def _advance(self) -> None:
        now = self._clock()
        dt, self._t = max(0.0, now - self._t), now
        self._closure += float(np.clip(self._target - self._closure, -self._speed * dt, self._speed * dt))

    def observe(self) -> float:
        self._require_connected()
        self._advance()
        return self._closure

    def send(self, closed: bool) -> None:
        self._require_connected()
        self._advance()
        self.commands.append(bool(closed))
        self._target = 1.0 if closed else 0.0

    def open(self, timeout_s: float) -> None:
        self._require_connected()
        self.commands.append(False)
        self._target = self._closure = 0.0


class SyntheticCamera(Camera):
    """A camera that draws a moving pattern (distinct per camera) so videos and payloads are not constant."""

    def __init__(self, name: str, height: int = 180, width: int = 320, fail_after: int | None = None):
        super().__init__(name)
        self.height, self.width = height, width
        self._frames = 0
        self._fail_after = fail_after
        self._tint = np.frombuffer(name.encode().ljust(3, b"x")[:3], dtype=np.uint8).astype(np.int32)

    def _connect(self) -> None:
        self._frames = 0

    def _disconnect(self) -> None:
        pass

    def observe(self) -> np.ndarray:
        self._require_connected()
        if self._fail_after is not None and self._frames >= self._fail_after:
            raise DeviceError(f"camera {self.name!r}: no frame within the timeout")
        self._frames += 1
        yy, xx = np.mgrid[0 : self.height, 0 : self.width]
        stripe = ((xx + 4 * self._frames) // 16 + yy // 16) % 2
        img = np.empty((self.height, self.width, 3), dtype=np.uint8)
        for c in range(3):
            img[..., c] = (stripe * 120 + self._tint[c]) % 256
        return img
