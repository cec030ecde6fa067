"""What both Franka control loops command the arm through: the `CommandGate` (arm commands from the loop and the
watchdog, one at a time; after a hold the command filtered before it is dropped) and the `Watchdog` that holds the arm
when no valid command went out in time (the loop is blocked, the server is gone)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from dreamzero_client.errors import ConfigError
from dreamzero_franka.common.contracts import Robot

logger = logging.getLogger(__name__)


class Watchdog:
    """Calls `on_expire` once when `feed()` was not called for `timeout_s`; the next `feed()` re-arms it.

    It runs in its own thread, so the arm is held even when the control loop itself is blocked (a hung server
    call, a stalled camera).
    """

    def __init__(self, timeout_s: float, on_expire: Callable[[], None], clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0:
            raise ConfigError(f"watchdog timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_expire = on_expire
        self._clock = clock
        self._last_feed = clock()
        self._fired = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.expirations = 0

    def feed(self) -> None:
        with self._lock:
            self._last_feed = self._clock()
            self._fired = False

    def check(self) -> bool:
        """Fire if overdue; returns True when it fired now (the thread calls this; tests may call it directly)."""
        with self._lock:
            overdue = not self._fired and self._clock() - self._last_feed > self.timeout_s
            if overdue:
                self._fired = True
                self.expirations += 1
        if overdue:
            self._on_expire()
        return overdue

    def start(self) -> Watchdog:
        self.feed()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="franka-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def _run(self) -> None:
        period = min(0.02, self.timeout_s / 4)
        while not self._stop.wait(period):
            try:
                self.check()
            except Exception:  # a failing hold must not kill the watchdog; the loop sees the device error itself
                logger.exception("watchdog: holding the arm failed")

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class CommandGate:
    """Serialises arm commands from the loop and the watchdog, and remembers whether the arm was held since."""

    def __init__(self, robot: Robot):
        self.robot = robot
        self._lock = threading.Lock()
        self._held = False
        self.holds = 0

    def send(self, joint_targets: np.ndarray) -> bool:
        """Send unless the watchdog held the arm since the loop last asked `was_held()`: that command was filtered
        against the pre-hold reference, so it is dropped and the next tick starts again from the measured position."""
        with self._lock:
            if self._held:
                return False
            self.robot.send(joint_targets)
            return True

    def send_pose(self, pose: np.ndarray, joint_hint: np.ndarray) -> bool:
        """A TCP pose target (franka_pnp; the robot is a `pnp.cartesian.CartesianRobot`); dropped after a hold, as
        `send`."""
        with self._lock:
            if self._held:
                return False
            self.robot.send_pose(pose, joint_hint)
            return True

    def hold(self) -> None:
        with self._lock:
            self.robot.hold()
            self._held = True
            self.holds += 1

    def was_held(self) -> bool:
        """True once after a hold: the next command must start from the measured position."""
        with self._lock:
            held, self._held = self._held, False
            return held
