"""The DROID client policy that the sim evaluation and the Franka loop share.

    policy = DroidPolicy(OpenPILink("ws://gpu-box:8000"), prompt="put the cube in the bowl")
    chunk = policy.infer(obs)   # obs: see `dreamzero_droid.droid`; -> Chunk(actions float64 [H, 8], ...)
    policy.observe(obs)         # every control step without a query: the frame history needs it
    policy.reset()              # release the session on the server and start a new one (a new session id)
    policy.close()

The interface is openpi's `BasePolicy` (infer / reset) plus `close`; `observe` feeds the frame history between
queries. The policy owns what every DROID client must get right once: the session id, the frame history, the
chunk check, and session continuity (the server's step and incarnation of the last reply go back with the next
query, and a reply that says the server restarted the session is flagged in `Chunk.restarted`). A `Link` carries a
`Query` over one transport (`dreamzero_droid.links`, or the in-process policy of `eval/`).

Real-time chunking (docs/rtc.md, "Clients"): `request(obs, rtc=RtcRequest(...))` asks the server to continue the
chunk the robot is executing (`dreamzero_droid.rtc.RtcSchedule` says when and with what). A server that refuses a
field of it (an older server answering 422 naming it) gets the query again without that field, and no RTC field
from then on; a server that ignores the fields (no `rtc` in its session report) gets none from then on either.
Both log one warning; the chunks are then plain ones, on the same timeline.

Every failure surfaces as `PolicyCallError` with a `reason` in FAILURE_REASONS; an unusable chunk is its subclass
`ChunkRejected`, so a robot loop may hold and retry while the evaluation records a failed episode.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dreamzero_client.errors import DreamZeroError, InvalidObservation
from dreamzero_droid import droid
from dreamzero_droid.rtc import RtcRequest, refused_fields

log = logging.getLogger("dreamzero.clients.policy")

FAILURE_REASONS = ("server_unreachable", "timeout", "error_reply", "bad_chunk")
#: restarts the client asked for; any other restart of a running session is flagged
CLIENT_RESTARTS = ("new_session", "reset_requested", "prompt_changed")


class PolicyCallError(DreamZeroError):
    """A policy call failed; `reason` is one of FAILURE_REASONS, `detail` what happened."""

    code = "policy_call_failed"

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class ChunkRejected(PolicyCallError, ValueError):
    """The reply is not a usable chunk (shape, dtype, non-finite values, too few rows)."""

    def __init__(self, detail: str, field: str = "actions"):
        super().__init__("bad_chunk", detail)
        self.field = field


def validate_chunk(actions: Any, action_dim: int = droid.ACTION_DIM, min_rows: int = 1) -> np.ndarray:
    """A finite float64 [H, action_dim] array with H >= min_rows (a batch of one is unwrapped), else ChunkRejected."""
    arr = np.asarray(actions) if isinstance(actions, np.ndarray | list | tuple) else None
    if arr is None or arr.dtype.kind not in "fiu":
        got = type(actions).__name__ if arr is None else f"dtype {arr.dtype}"
        raise ChunkRejected(f"actions: expected a real numeric array, got {got}")
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[1] != action_dim:
        raise ChunkRejected(f"actions: expected shape (H, {action_dim}), got {arr.shape}")
    if arr.shape[0] < min_rows:
        raise ChunkRejected(f"actions: expected at least {min_rows} rows, got {arr.shape[0]}")
    arr = arr.astype(np.float64)
    bad = ~np.isfinite(arr)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ChunkRejected(f"actions: {int(bad.sum())} non-finite values (first at row {row}, column {col})")
    return arr


def classify_failure(exc: BaseException) -> str:
    """The FAILURE_REASONS entry of a client exception, by the kind of failure (names keep transports optional)."""
    if isinstance(exc, PolicyCallError):
        return exc.reason
    names = {cls.__name__ for cls in type(exc).__mro__}
    if isinstance(exc, TimeoutError) or names & {"ReplyTimeout", "TimeoutException"}:
        return "timeout"
    if "ProtocolError" in names:  # the reply could not be read as actions
        return "bad_chunk"
    if "ServerError" in names:  # the server answered with an error (4xx, error frame, text frame)
        return "error_reply"
    transport = {"ServerUnavailableError", "ConnectionClosed", "InvalidHandshake", "InvalidStatus", "TransportError"}
    if isinstance(exc, ConnectionError | OSError | EOFError) or names & transport:
        return "server_unreachable"
    return "error_reply"


def as_call_error(exc: BaseException) -> PolicyCallError:
    if isinstance(exc, PolicyCallError):
        return exc
    return PolicyCallError(classify_failure(exc), f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Query:
    """What a link sends: the frames of one query and the session's continuity fields."""

    session_id: str
    prompt: str
    frames: list[droid.Frame]  # 1 on a session's first query, else 4 at droid.FRAME_OFFSETS
    first_call: bool
    expected_step: int | None = None  # `step` of the session's last reply
    expected_incarnation: str | None = None  # `incarnation` of the session's last reply
    rtc: RtcRequest | None = None  # real-time chunking: continue the chunk being executed (None: a plain query)
    # the fleet's fields (docs/fleet.md), sent only when set: when the observation was taken (the client's clock, s;
    # the server echoes it), "realtime" | "batch", and ms until this robot runs out of actions
    observed_at: float | None = None
    traffic_class: str | None = None
    deadline_ms: float | None = None
    seq: int | None = None  # the query's number in its session (1, 2, ...): a late reply of an older one is known


@dataclass(frozen=True)
class LinkReply:
    actions: Any  # checked by the policy
    session: dict | None = None  # the server's session report (session_id, step, incarnation, restarted, ...)
    timings: dict = field(default_factory=dict)  # ms per server stage
    video: Any = None  # uint8 [T, H, W, 3] predicted frames, from a link asked for them (`return_video`)


@runtime_checkable
class Link(Protocol):
    name: str

    def send(self, query: Query) -> LinkReply: ...

    def reset(self, session_id: str) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Chunk:
    actions: np.ndarray  # float64 [H, 8]: 7 absolute joint targets (rad) + gripper in [0, 1]
    latency_ms: float  # round trip of the query, as the client saw it
    session_id: str
    session: dict | None = None  # the server's session report, when the link carries one
    timings: dict = field(default_factory=dict)
    restarted: str | None = None  # why the server restarted a running session (state lost), else None
    rtc_request: RtcRequest | None = None  # what the query asked (None: plain, or RTC dropped after a refusal)
    rtc: str | None = None  # the server's `session.rtc`: "client_prefix" | "session_cache" | "cold_start"
    video: np.ndarray | None = None  # uint8 [T, H, W, 3]: the model's predicted frames of this chunk, when asked


@runtime_checkable
class BasePolicy(Protocol):
    def infer(self, obs: dict) -> Chunk: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class SessionPolicy:
    """What every embodiment's client policy shares: one server session at a time over a link (a session id with
    `session_prefix`, released by `reset`), the continuity fields (the last reply's step and incarnation go back with
    the next query) and the restart report. An embodiment adds its observation: `observe` (a control step without a
    query), `request` (the query of a step) and `send` (the link's reply read into a `Chunk`), as `DroidPolicy` below
    and `dreamzero_franka.pnp.policy.PnpPolicy` do. Thread-safe enough for one background query (prefetch)."""

    def __init__(self, link: Link, prompt: str | None = None, min_rows: int = 1, session_prefix: str = "policy"):
        if prompt is not None and not prompt.strip():
            raise InvalidObservation("prompt: expected a non-empty instruction", field="prompt")
        self.link, self.prompt, self.min_rows, self.session_prefix = link, prompt, min_rows, session_prefix
        self._lock = threading.Lock()
        self._new_session()

    @property
    def name(self) -> str:
        return getattr(self.link, "name", type(self.link).__name__)

    def _new_session(self) -> None:
        self.session_id = f"{self.session_prefix}-{uuid.uuid4().hex}"
        self.calls = 0
        self._last_step: int | None = None
        self._last_incarnation: str | None = None
        self._answered_seq = 0  # the newest query whose reply set the continuity fields

    def observe(self, obs: dict) -> None:
        raise NotImplementedError

    def request(self, obs: dict) -> Any:
        raise NotImplementedError

    def send(self, query: Any) -> Chunk:
        raise NotImplementedError

    def infer(self, obs: dict) -> Chunk:
        return self.send(self.request(obs))

    def _continuity(self, query: Any, report: dict | None) -> str | None:
        """Keep the step and incarnation of the last reply; say why a running session was restarted, if it was."""
        if not isinstance(report, dict):
            return None
        with self._lock:
            if query.session_id != self.session_id:
                return None  # a late reply of a session that was reset meanwhile
            seq = getattr(query, "seq", None)
            if seq is not None:
                if seq < self._answered_seq:
                    return None  # a late reply of an older query (abandoned after a timeout): a newer one counts
                self._answered_seq = seq
            if isinstance(report.get("step"), int):
                self._last_step = report["step"]
            if isinstance(report.get("incarnation"), str):
                self._last_incarnation = report["incarnation"]
        reason = report.get("restart_reason")
        if query.first_call or not report.get("restarted") or reason in CLIENT_RESTARTS:
            return None
        log.warning("session %s was restarted by the server (%s): its video history is lost", query.session_id, reason)
        return str(reason or "restarted")

    def reset(self) -> None:
        """Release the current session on the server (if it was used) and start a new one with a new id."""
        with self._lock:
            old, used = self.session_id, self.calls > 0
            self._new_session()
        if used:
            try:
                self.link.reset(old)
            except Exception as exc:
                raise as_call_error(exc) from exc

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> SessionPolicy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DroidPolicy(SessionPolicy):
    """One DROID session at a time over any `Link`: DROID's frames (`droid.FrameHistory`) and real-time chunking."""

    def __init__(
        self,
        link: Link,
        prompt: str | None = None,
        image_hw: tuple[int, int] = droid.IMAGE_HW,
        min_rows: int = 1,
        session_prefix: str = "droid",
    ):
        self.image_hw = image_hw
        self.history = droid.FrameHistory()
        self.rtc_fallback: str | None = None  # why RTC fields are no longer sent (None: sent when asked)
        self._prefix_refused = False  # the server refused `action_prefix` only: d and s are still sent
        super().__init__(link, prompt=prompt, min_rows=min_rows, session_prefix=session_prefix)

    def _new_session(self) -> None:
        super()._new_session()
        self.history.clear()

    # 1. Queries ------------------------------------------------------------------------------------------------
    def observe(self, obs: dict) -> None:
        """Record a control step that does not query (the frame history holds one frame per step)."""
        frame = droid.make_frame(obs, self.image_hw)
        with self._lock:
            self.history.append(frame)

    def request(
        self,
        obs: dict,
        rtc: RtcRequest | None = None,
        record: bool = True,
        observed_at: float | None = None,
        traffic_class: str | None = None,
        deadline_ms: float | None = None,
    ) -> Query:
        """Build the query of `obs` now (a background `send` then uses this step's frames), recording its frame
        unless `record` is False (`observe` already did this step). `rtc`: continue the executing chunk;
        `observed_at`, `traffic_class`, `deadline_ms`: the fleet's fields of `Query` (None: not sent)."""
        prompt = obs.get("prompt", self.prompt) if isinstance(obs, dict) else self.prompt
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidObservation("prompt: expected a non-empty instruction", field="prompt")
        frame = droid.make_frame(obs, self.image_hw) if record else None
        with self._lock:
            if frame is not None:
                self.history.append(frame)
            first = self.calls == 0
            self.calls += 1
            frames = self.history.select(first)
            return Query(self.session_id, prompt, frames, first, self._last_step, self._last_incarnation,
                         self._allowed(rtc), observed_at, traffic_class, deadline_ms, self.calls)  # fmt: skip

    def send(self, query: Query) -> Chunk:
        start = time.perf_counter()
        reply, query = self._send_with_fallback(query)
        latency_ms = (time.perf_counter() - start) * 1e3
        actions = validate_chunk(reply.actions, min_rows=self.min_rows)
        source = reply.session.get("rtc") if isinstance(reply.session, dict) else None
        if query.rtc is not None and source is None:
            self._stop_rtc("the server ignored the RTC fields (its reply has no session.rtc): an older server")
        video = None if reply.video is None else np.asarray(reply.video, dtype=np.uint8)
        if video is not None and video.ndim == 5:  # a one-row batch: this session's frames
            video = video[0]
        return Chunk(actions, latency_ms, query.session_id, reply.session, dict(reply.timings or {}),
                     self._continuity(query, reply.session), query.rtc, source, video)  # fmt: skip

    def _send_with_fallback(self, query: Query) -> tuple[LinkReply, Query]:
        """The link's reply; an error reply naming an RTC field is answered by asking again without it (at most
        twice: the prefix, then all of RTC). Other failures are translated, never swallowed."""
        while True:
            try:
                return self.link.send(query), query
            except Exception as exc:  # the caller ends the episode (or holds) with the reason
                error = as_call_error(exc)
                named = refused_fields(exc) if query.rtc is not None and error.reason == "error_reply" else set()
                if not named:
                    raise error from exc
                if named == {"action_prefix"} and query.rtc.action_prefix is not None:
                    with self._lock:
                        self._prefix_refused = True
                    log.warning("the server refused action_prefix (%s): RTC goes on without it", error.detail)
                    query = dataclasses.replace(query, rtc=query.rtc.without_prefix())
                else:
                    self._stop_rtc(f"the server refused {sorted(named)}: {error.detail}")
                    query = dataclasses.replace(query, rtc=None)

    def _allowed(self, rtc: RtcRequest | None) -> RtcRequest | None:
        """What of `rtc` the server has not refused (call under the lock)."""
        if rtc is None or self.rtc_fallback is not None:
            return None
        return rtc.without_prefix() if self._prefix_refused else rtc

    def _stop_rtc(self, why: str) -> None:
        with self._lock:
            if self.rtc_fallback is not None:
                return
            self.rtc_fallback = why
        log.warning("real-time chunking off, plain chunks from now on: %s", why)
