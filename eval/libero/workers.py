"""One LIBERO env per worker process, so that a hung or crashed simulator costs one episode, never the run.

The parent sends a command to every worker of a step first and then collects the answers against one deadline, so
B environments advance in parallel and a step takes at most `timeout_s`. A worker that misses the deadline is killed;
one that raises answers with the error. Either way the caller gets `EnvFailure` with a reason:
"env_timeout", "env_error" or "env_died" (the process exited), and replaces the worker before its next episode.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

import numpy as np

from eval.libero.adapter import SETTLE_ACTION, LiberoFrame, frame_from_obs

ENV_FAILURE_REASONS = ("env_timeout", "env_error", "env_died")
_JOIN_S = 5.0


class EnvFailure(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


def _serve(conn, backend) -> None:
    """The worker's loop: ("reset", task_id, init_index, settle_steps) | ("step", action) | ("close",)."""
    env, env_task = None, None
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the parent went away
                return
            if msg[0] == "close":
                return
            try:
                if msg[0] == "reset":
                    _, task_id, init_index, settle_steps = msg
                    if env is None or env_task != task_id:
                        if env is not None:
                            env.close()
                        env, env_task = None, None
                        env, env_task = backend.make(task_id), task_id
                    obs = env.reset(init_index)
                    for _ in range(settle_steps):
                        obs = env.step(SETTLE_ACTION)
                elif msg[0] == "step":
                    if env is None:
                        raise RuntimeError("step before reset")
                    obs = env.step(msg[1])
                else:
                    raise ValueError(f"unknown worker command {msg[0]!r}")
                conn.send(("ok", frame_from_obs(obs), bool(env.is_success())))
            except Exception as exc:  # noqa: BLE001  (every failure goes back to the parent with its traceback tail)
                tail = traceback.format_exc(limit=4)[-1500:]
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{tail}"))
    finally:
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001  (closing a broken env must not mask why we stop)
                pass


class EnvWorker:
    """A child process owning one env; `send_*` then `receive(deadline)`."""

    def __init__(self, backend: Any, name: str, start_method: str = "spawn"):
        ctx = mp.get_context(start_method)
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, backend), name=name, daemon=True)
        self._proc.start()
        child.close()

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def send_reset(self, task_id: int, init_index: int, settle_steps: int) -> None:
        self._send(("reset", int(task_id), int(init_index), int(settle_steps)))

    def send_step(self, action: np.ndarray) -> None:
        self._send(("step", np.asarray(action, dtype=np.float64)))

    def _send(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            message = f"{self.name} cannot take commands ({exc}); exit code {self._proc.exitcode}"
            raise EnvFailure("env_died", message) from None

    def receive(self, deadline: float) -> tuple[LiberoFrame, bool]:
        """The answer to the last command by `deadline` (time.monotonic()), else EnvFailure (the worker is killed)."""
        try:
            ready = self._conn.poll(max(0.0, deadline - time.monotonic()))
        except (OSError, EOFError):
            ready = True  # a broken pipe reads as EOF below
        if not ready:
            self.kill()
            raise EnvFailure("env_timeout", f"{self.name} did not answer in time; killed")
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(_JOIN_S)
            raise EnvFailure("env_died", f"{self.name} exited (exit code {self._proc.exitcode})") from None
        if reply[0] == "error":
            raise EnvFailure("env_error", reply[1])
        return reply[1], reply[2]

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(_JOIN_S)
        self._conn.close()

    def close(self) -> None:
        """Ask the worker to close its env and exit; kill it if it does not within a few seconds."""
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except (OSError, ValueError):
                pass
            self._proc.join(_JOIN_S)
        self.kill()
