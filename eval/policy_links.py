"""The policy-link contract of the evaluation runner, and its three implementations.

The runner never talks to a client class directly: it calls a `PolicyLink`, so the OpenPI WebSocket client, the HTTP
action client and the in-process embedded policy are interchangeable (and a test can pass a fake).

    infer(frames, instruction, session_id) -> ChunkReply(actions [H, 8], latency_s, ...)
        `frames` is the episode's observation history (oldest first, the current observation last), already resized
        to 180x320; a link sends what its wire needs (the OpenPI server buffers frames itself; the raw HTTP form and
        the embedded policy get 1 frame on a session's first call, then 4 frames at offsets [-23, -16, -8, 0]).
    reset(session_id)   forget the session on the server (called after every episode)
    close()

Every failure of a call surfaces as `PolicyLinkError` with a machine-readable `reason`, so the runner can record the
episode as failed and go on: "server_unreachable", "timeout", "error_reply" (the server answered with an error) or
"bad_chunk" (an answer that is not a finite [H, 8] array).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dreamzero.errors import DreamZeroError
from eval.env_contract import ACTION_DIM, IMAGE_KEYS

FAILURE_REASONS = ("server_unreachable", "timeout", "error_reply", "bad_chunk")
#: frames sent by the raw-form links after a session's first call (DreamZero's DROID client offsets)
FRAME_OFFSETS = (-23, -16, -8, 0)
#: history the runner must keep for FRAME_OFFSETS
HISTORY_LEN = -FRAME_OFFSETS[0] + 1


class PolicyLinkError(DreamZeroError):
    """A policy call failed; `reason` is one of FAILURE_REASONS."""

    code = "policy_link_error"

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


@dataclass
class ChunkReply:
    actions: np.ndarray  # float64 [H, 8]: 7 absolute joint targets (rad) + gripper in [0, 1]
    latency_s: float  # wall time of the call, as the client saw it
    server_timings_ms: dict[str, float] = field(default_factory=dict)
    session: dict[str, Any] | None = None  # the server's SessionReport for this call, when the wire carries one


@runtime_checkable
class PolicyLink(Protocol):
    name: str

    def infer(self, frames: list[dict], instruction: str, session_id: str) -> ChunkReply: ...

    def reset(self, session_id: str) -> None: ...

    def close(self) -> None: ...


# 1. Helpers shared by the links ---------------------------------------------------------------------------------------
def validate_chunk(actions: Any, action_dim: int = ACTION_DIM) -> np.ndarray:
    """A finite float [H, action_dim] array, else PolicyLinkError("bad_chunk") saying what arrived."""
    try:
        arr = np.asarray(actions, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PolicyLinkError("bad_chunk", f"actions are not numeric ({type(actions).__name__}): {exc}") from exc
    if arr.ndim == 3 and arr.shape[0] == 1:  # a batch of one
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != action_dim:
        raise PolicyLinkError("bad_chunk", f"actions: expected [H, {action_dim}], got shape {list(arr.shape)}")
    if not np.all(np.isfinite(arr)):
        raise PolicyLinkError("bad_chunk", f"actions: {int((~np.isfinite(arr)).sum())} non-finite values")
    return arr


def classify_failure(exc: BaseException) -> str:
    """Map a client exception onto a FAILURE_REASONS entry by what kind of failure it is.

    Names rather than imports keep this module free of the client libraries
    (dreamzero_client.errors, websockets, httpx).
    """
    if isinstance(exc, PolicyLinkError):
        return exc.reason
    names = {cls.__name__ for cls in type(exc).__mro__}
    if isinstance(exc, TimeoutError) or names & {"ReplyTimeout", "TimeoutException"}:
        return "timeout"
    if names & {"ProtocolError"}:  # the reply could not be read as actions
        return "bad_chunk"
    if names & {"ServerError"}:  # the server answered with an error (4xx, error frame, text frame)
        return "error_reply"
    transport = {"ServerUnavailableError", "ConnectionClosed", "InvalidHandshake", "InvalidStatus", "TransportError"}
    if isinstance(exc, ConnectionError | OSError | EOFError) or names & transport:
        return "server_unreachable"
    return "error_reply"


def _wrap(exc: BaseException) -> PolicyLinkError:
    if isinstance(exc, PolicyLinkError):
        return exc
    return PolicyLinkError(classify_failure(exc), f"{type(exc).__name__}: {exc}")


def select_frames(frames: list[dict], first_call: bool) -> list[dict]:
    """1 frame on a session's first call, else the frames at FRAME_OFFSETS (clamped to the episode's start)."""
    if first_call:
        return [frames[-1]]
    last = len(frames) - 1
    return [frames[max(0, last + off)] for off in FRAME_OFFSETS]


def raw_observation(frames: list[dict]) -> dict[str, np.ndarray]:
    """The embodiment-keyed raw form for one session: video [1, T, H, W, 3], state [1, 1, 7] / [1, 1, 1]."""
    key_map = dict(
        zip(IMAGE_KEYS, ("video.exterior_image_1_left", "video.exterior_image_2_left", "video.wrist_image_left"))
    )
    obs = {dst: np.stack([f[src] for f in frames])[None] for src, dst in key_map.items()}
    obs["state.joint_position"] = np.asarray(frames[-1]["joint_position"], dtype=np.float32).reshape(1, 1, 7)
    obs["state.gripper_position"] = np.asarray(frames[-1]["gripper_position"], dtype=np.float32).reshape(1, 1, 1)
    return obs


def openpi_request(frame: dict, instruction: str, session_id: str) -> dict:
    """The DROID OpenPI infer message for one observation (the server keeps its own frame buffer)."""
    return {
        "observation/exterior_image_0_left": frame["exterior_image_0_left"],
        "observation/exterior_image_1_left": frame["exterior_image_1_left"],
        "observation/wrist_image_left": frame["wrist_image_left"],
        "observation/joint_position": np.asarray(frame["joint_position"], dtype=np.float32),
        "observation/gripper_position": np.asarray(frame["gripper_position"], dtype=np.float32),
        "observation/cartesian_position": np.zeros(6, dtype=np.float32),  # unused by DreamZero; DROID clients send it
        "prompt": instruction,
        "session_id": session_id,
    }


# 2. OpenPI WebSocket -------------------------------------------------------------------------------------------------
class OpenPILink:
    """Talks to the OpenPI WebSocket endpoint through `dreamzero_client.openpi_client.OpenPIClient`.

    The connection is opened lazily and dropped after a transport failure, so the next episode reconnects (and fails
    fast with "server_unreachable" while the server is gone).
    """

    name = "openpi"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = 8000,
        path: str = "/",
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_reconnects: int = 1,
        client_factory=None,
    ):
        self.host, self.port, self.path, self.api_key, self.timeout_s = host, port, path, api_key, timeout_s
        self.max_reconnects = max_reconnects
        self._factory = client_factory or self._default_factory
        self._client = None
        self.server_metadata: dict | None = None

    def _default_factory(self):
        from dreamzero_client.openpi_client import OpenPIClient

        return OpenPIClient(
            self.host,
            port=self.port,
            path=self.path,
            api_key=self.api_key,
            timeout_s=self.timeout_s,
            max_reconnects=self.max_reconnects,
        )

    def _connected(self):
        if self._client is None:
            try:
                self._client = self._factory()
                self.server_metadata = dict(self._client.get_server_metadata() or {})
            except Exception as exc:
                self._drop()
                raise _wrap(exc) from exc
        return self._client

    def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead socket may raise; the connection is gone either way
                pass

    def infer(self, frames: list[dict], instruction: str, session_id: str) -> ChunkReply:
        client = self._connected()
        start = time.perf_counter()
        try:
            reply = client.infer(openpi_request(frames[-1], instruction, session_id))
        except Exception as exc:
            err = _wrap(exc)
            if err.reason in ("server_unreachable", "timeout"):
                self._drop()
            raise err from exc
        latency = time.perf_counter() - start
        actions = reply.get("actions") if isinstance(reply, dict) else reply
        if actions is None:
            raise PolicyLinkError("bad_chunk", f"reply has no 'actions' (keys: {sorted(reply)})")
        timings = reply.get("timings", {}) if isinstance(reply, dict) else {}
        session = reply.get("session") if isinstance(reply, dict) else None
        return ChunkReply(validate_chunk(actions), latency, dict(timings or {}), session)

    def reset(self, session_id: str) -> None:
        if self._client is None:
            return  # nothing to reset: the server freed the session with the connection
        try:
            self._client.reset(session_id)
        except Exception as exc:
            self._drop()
            raise _wrap(exc) from exc

    def close(self) -> None:
        self._drop()


# 3. HTTP action endpoint (raw form) -----------------------------------------------------------------------------------
class HttpLink:
    """`POST /v1/actions/generations` through `dreamzero_client.http_client.ActionClient`, raw form, one row."""

    name = "http"

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 2,
        client=None,
    ):
        if client is None:
            from dreamzero_client.http_client import ActionClient

            # fewer retries than the client's default: a dead server should fail an episode in seconds, not minutes
            client = ActionClient(base_url, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries)
        self._client = client
        self._calls: dict[str, int] = {}

    def infer(self, frames: list[dict], instruction: str, session_id: str) -> ChunkReply:
        first = self._calls.get(session_id, 0) == 0
        obs = raw_observation(select_frames(frames, first))
        start = time.perf_counter()
        try:
            result = self._client.generate(obs, [instruction], [session_id], form="raw")
        except Exception as exc:
            raise _wrap(exc) from exc
        latency = time.perf_counter() - start
        self._calls[session_id] = self._calls.get(session_id, 0) + 1
        sessions = getattr(result, "sessions", None) or [None]
        session = sessions[0].to_dict() if hasattr(sessions[0], "to_dict") else sessions[0]
        timings = dict(getattr(result, "timings", None) or {})
        return ChunkReply(validate_chunk(getattr(result, "actions", None)), latency, timings, session)

    def reset(self, session_id: str) -> None:
        # Session ids are never reused (a new uuid per episode), so forgetting the id is the reset; the server evicts
        # the idle state by LRU/TTL.
        self._calls.pop(session_id, None)
        forget = getattr(self._client, "forget_sessions", None)
        if callable(forget):
            forget([session_id])

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if callable(close):
            close()


# 4. Embedded policy (in-process, no server) ---------------------------------------------------------------------------
class EmbeddedLink:
    """Runs `dreamzero.policy.EmbeddedPolicy` in this process (the tiny random model when no path is given)."""

    name = "embedded"

    def __init__(self, model_path: str | None = None, embodiment: str = "oxe_droid", policy=None):
        if policy is None:
            from dreamzero.policy import EmbeddedPolicy

            policy = EmbeddedPolicy.load(model_path=model_path, embodiment=embodiment)
        self._policy = policy
        self._calls: dict[str, int] = {}

    def infer(self, frames: list[dict], instruction: str, session_id: str) -> ChunkReply:
        first = self._calls.get(session_id, 0) == 0
        obs = raw_observation(select_frames(frames, first))
        start = time.perf_counter()
        try:
            result = self._policy.infer(obs, [session_id], instructions=[instruction])
        except Exception as exc:
            raise PolicyLinkError("error_reply", f"{type(exc).__name__}: {exc}") from exc
        latency = time.perf_counter() - start
        self._calls[session_id] = self._calls.get(session_id, 0) + 1
        sessions = getattr(result, "sessions", None) or [None]
        session = sessions[0].to_dict() if hasattr(sessions[0], "to_dict") else sessions[0]
        timings = dict(getattr(result, "timings_ms", None) or getattr(result, "timings", None) or {})
        return ChunkReply(validate_chunk(getattr(result, "actions", None)), latency, timings, session)

    def reset(self, session_id: str) -> None:
        self._calls.pop(session_id, None)
        self._policy.reset([session_id])

    def close(self) -> None:
        close = getattr(self._policy, "close", None)
        if callable(close):
            close()


LINKS = ("openpi", "http", "embedded")


def make_policy_link(kind: str, **kwargs) -> PolicyLink:
    """`kind` in LINKS; kwargs go to the link's constructor."""
    from dreamzero.errors import ConfigError

    classes = {"openpi": OpenPILink, "http": HttpLink, "embedded": EmbeddedLink}
    if kind not in classes:
        raise ConfigError(f"policy: expected one of {LINKS}, got {kind!r}")
    return classes[kind](**kwargs)
