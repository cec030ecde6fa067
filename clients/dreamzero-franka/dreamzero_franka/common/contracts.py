"""Contracts for the hardware the deployment loop drives: an arm, a gripper and cameras.

The control loop (`loop.py`) is written only against these classes, so the real franky/RealSense backends, the
simulated ones in `sim_backends.py` and test fakes are interchangeable. Every device follows the same life cycle:
`connect()` -> `observe()` / `send(...)` -> `disconnect()`, and works as a context manager.

Conventions (DROID): 7 joint positions in radians; gripper closure in [0, 1] (0 open, 1 closed); images are uint8
RGB arrays of shape (H, W, 3).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from dreamzero_client.errors import DreamZeroError

NUM_JOINTS = 7


class DeviceError(DreamZeroError, RuntimeError):
    """A device failed (not connected, lost connection, reflex / safety stop, frame timeout)."""

    code = "device_error"


class RobotFault(DeviceError):
    """The arm refused or aborted a motion (a reflex, a limit violation reported by the controller, ...)."""

    code = "robot_fault"


@dataclass(frozen=True)
class ArmState:
    """One reading of the arm."""

    joint_positions: np.ndarray  # float64 (7,), rad
    joint_velocities: np.ndarray  # float64 (7,), rad/s (zeros when the backend cannot measure them)


class Device(abc.ABC):
    """Connect / disconnect life cycle shared by every device, with context-manager use."""

    _connected: bool = False

    @property
    def is_connected(self) -> bool:
        return self._connected

    def connect(self) -> None:
        if not self._connected:
            self._connect()
            self._connected = True

    def disconnect(self) -> None:
        if self._connected:
            try:
                self._disconnect()
            finally:
                self._connected = False

    def _require_connected(self) -> None:
        if not self._connected:
            raise DeviceError(f"{type(self).__name__} is not connected; call connect() first (or use `with`).")

    @abc.abstractmethod
    def _connect(self) -> None: ...

    @abc.abstractmethod
    def _disconnect(self) -> None: ...

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.disconnect()


class Robot(Device):
    """A 7-joint arm driven by absolute joint-position targets."""

    @abc.abstractmethod
    def observe(self) -> ArmState:
        """The current measured joint state."""

    @abc.abstractmethod
    def send(self, joint_targets: np.ndarray) -> None:
        """Start moving towards absolute joint targets (7,) and return at once (a new target preempts the last).

        Callers must pass targets that already went through `safety.SafetyFilter`; raises `RobotFault` when the
        controller rejected or aborted the motion.
        """

    @abc.abstractmethod
    def move_to(self, joint_positions: np.ndarray, timeout_s: float) -> None:
        """Blocking, slow point-to-point move (used to go home between episodes)."""

    @abc.abstractmethod
    def hold(self) -> None:
        """Stop any motion and hold the current position. Must be safe to call at any time, from any thread."""

    def recover(self) -> bool:
        """Clear recoverable controller errors; True when the arm can move again."""
        return True


class Gripper(Device):
    """A parallel gripper commanded open/closed (the policy's gripper output is binarised before it gets here)."""

    @abc.abstractmethod
    def observe(self) -> float:
        """Closure in [0, 1]: 0 fully open, 1 fully closed."""

    @abc.abstractmethod
    def send(self, closed: bool) -> None:
        """Start closing (grasp) or opening and return at once."""

    @abc.abstractmethod
    def open(self, timeout_s: float) -> None:
        """Blocking full open (used at episode start)."""


class Camera(Device):
    """A colour camera returning RGB frames."""

    def __init__(self, name: str):
        self.name = name

    @abc.abstractmethod
    def observe(self) -> np.ndarray:
        """The latest frame: uint8 (H, W, 3) RGB."""
