"""Adapter between the control loop and the project's policy clients (OpenPI WebSocket, or anything alike).

The loop needs three things from a server: start a fresh session (new id + reset), turn one observation into a
validated (H, 8) chunk with its latency, and close. Any transport with `infer(obs) -> {"actions": array} | array`,
`reset()` and `close()` works (`dreamzero_client.openpi_client.OpenPIClient` is the one we ship; tests use fakes).
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from dreamzero_client.errors import ConfigError, DreamZeroError, InvalidObservation
from dreamzero_client.franka.images import resize_with_pad
from dreamzero_client.franka.safety import validate_chunk

#: camera role -> OpenPI / DROID observation key
CAMERA_KEYS = {
    "exterior_0": "observation/exterior_image_0_left",
    "exterior_1": "observation/exterior_image_1_left",
    "wrist": "observation/wrist_image_left",
}


class PolicyTransport(Protocol):
    def infer(self, obs: dict) -> Any: ...

    def reset(self, session_id: str | None = None) -> Any: ...

    def close(self) -> None: ...


class PolicyError(DreamZeroError, ConnectionError):
    """The server could not be reached, timed out, or answered with an error. `reason` is logged per episode."""

    code = "policy_unavailable"

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Chunk:
    actions: np.ndarray  # float64 (H, 8): 7 absolute joint targets (rad) + gripper in [0, 1]
    latency_ms: float  # round trip of the infer call
    session_id: str
    extras: dict = field(default_factory=dict)  # small non-array fields of the reply (session reports, timings)


class DroidPolicy:
    """Builds DROID OpenPI observations, keeps the episode's session id, validates every chunk."""

    def __init__(
        self,
        transport: PolicyTransport,
        prompt: str,
        image_hw: tuple[int, int] = (180, 320),
        min_rows: int = 8,
    ):
        if not prompt or not prompt.strip():
            raise InvalidObservation("prompt must be a non-empty instruction", field="prompt")
        self.transport = transport
        self.prompt = prompt
        self.image_hw = image_hw
        self.min_rows = min_rows
        self.session_id = ""

    def new_session(self) -> str:
        """Take a fresh session id and reset the server-side session (called at the start of every episode)."""
        self.session_id = f"franka-{uuid.uuid4().hex}"
        try:
            self.transport.reset(self.session_id)
        except Exception as exc:  # any transport failure means we cannot trust the server's session state
            raise PolicyError(f"server reset failed: {type(exc).__name__}: {exc}") from exc
        return self.session_id

    def build_observation(self, joints: np.ndarray, gripper: float, images: dict[str, np.ndarray]) -> dict:
        missing = sorted(set(CAMERA_KEYS) - set(images))
        if missing:
            raise InvalidObservation(f"camera images missing for roles {missing}", field="images")
        obs = {
            key: resize_with_pad(images[role], *self.image_hw, field=f"images[{role!r}]")
            for role, key in CAMERA_KEYS.items()
        }
        obs["observation/joint_position"] = np.asarray(joints, dtype=np.float32).reshape(7)
        obs["observation/gripper_position"] = np.array([gripper], dtype=np.float32)
        obs["observation/cartesian_position"] = np.zeros(6, dtype=np.float32)  # DROID key; DreamZero ignores it
        obs["prompt"] = self.prompt
        obs["session_id"] = self.session_id
        return obs

    def infer(self, obs: dict) -> Chunk:
        """One round trip. Raises `PolicyError` (server lost) or `safety.ChunkRejected` (unusable chunk)."""
        start = time.monotonic()
        try:
            reply = self.transport.infer(obs)
        except Exception as exc:  # translated, not swallowed: the loop ends the episode with this reason
            raise PolicyError(f"server lost: {type(exc).__name__}: {exc}") from exc
        latency_ms = (time.monotonic() - start) * 1e3
        extras: dict = {}
        if isinstance(reply, dict):
            actions = reply.get("actions")
            extras = {k: v for k, v in reply.items() if k != "actions" and not isinstance(v, np.ndarray | bytes)}
        else:
            actions = reply
        chunk = validate_chunk(actions, min_rows=self.min_rows)
        return Chunk(actions=chunk, latency_ms=latency_ms, session_id=self.session_id, extras=extras)

    def close(self) -> None:
        self.transport.close()


class HttpTransport:
    """Runs the DROID OpenPI observation over `POST /v1/actions/generations` (raw form, one session per call).

    The WebSocket server buffers one frame per call itself; over HTTP the client sends the history: one frame on a
    session's first call, then the frames of the last 4 calls (the oldest repeated while there are fewer), which is
    what the model was trained on when querying every 8 steps. A lone frame after the first call would make the
    server restart the session (`single_frame`).
    """

    STACK = 4

    def __init__(self, client):
        from dreamzero_client.wire.openpi import OPENPI_DROID_KEY_MAP

        self.client = client  # dreamzero_client.http_client.ActionClient
        self._key_map = OPENPI_DROID_KEY_MAP
        self._session: str | None = None
        self._frames: dict[str, deque] = {}

    def infer(self, obs: dict) -> dict:
        session_id = obs["session_id"]
        if session_id != self._session:
            self._session, self._frames = session_id, {}
        observation = {}
        for key, raw_key in self._key_map.items():
            value = np.asarray(obs[key])
            if raw_key.startswith("video."):
                history = self._frames.setdefault(raw_key, deque(maxlen=self.STACK))
                first_call = not history
                history.append(value)
                frames = [value] if first_call else [history[0]] * (self.STACK - len(history)) + list(history)
                observation[raw_key] = np.stack(frames)[None]  # [B=1, T, H, W, 3]
            else:
                observation[raw_key] = value[None]  # [B=1, D]
        result = self.client.generate(observation, obs["prompt"], session_id, form="raw")
        return {"actions": result.actions[0], "sessions": result.sessions, "timings": result.timings}

    def reset(self, session_id: str | None = None) -> dict:
        self._session, self._frames = session_id, {}
        if session_id is not None:
            self.client.reset_sessions(session_id)  # sets reset_mask on the session's next call
        return {"status": "reset scheduled"}

    def close(self) -> None:
        self.client.close()


def connect_policy(url: str, api_key: str | None = None, timeout_s: float = 30.0, max_reconnects: int = 1):
    """A transport for `url`: ws:// / wss:// -> OpenPI WebSocket client; http:// / https:// -> the HTTP client."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("ws", "wss"):
        from dreamzero_client.openpi_client import OpenPIClient

        return OpenPIClient(url, api_key=api_key, timeout_s=timeout_s, max_reconnects=max_reconnects)
    if scheme in ("http", "https"):
        from dreamzero_client.http_client import ActionClient

        return HttpTransport(ActionClient(url, api_key=api_key, timeout_s=timeout_s, max_retries=max_reconnects))
    raise ConfigError(f"--server must be a ws://, wss://, http:// or https:// URL, got {url!r}")
