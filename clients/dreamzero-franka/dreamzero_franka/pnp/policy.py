"""The franka_pnp client policy: the shared session rules (`SessionPolicy`) over franka_pnp's observation.

    policy = PnpPolicy(PnpOpenPILink("ws://gpu-box:8000"), prompt="put the red block in the bin")
    chunk = policy.infer(builder.build(exterior, wrist, tcp, closure, prompt))  # -> Chunk(actions float64 [H, 7])
    policy.reset()   # release the session on the server; a new session id
    policy.close()

Session id, continuity fields (the last reply's step / incarnation go back with the next query) and the failure
classification are `SessionPolicy`'s; the frame rule is DROID's too: the policy keeps one observation per control step
(`observe` on the steps without a query), a session's first query sends 1 frame of each view and every later one
4, since the server continues a session only on a 4-frame block (a 1-frame input restarts it, `single_frame`). The
block spans the rows executed since the last query: for 12 rows the frames 9, 6, 3 and 0 steps back
(`frame_offsets`), so no frame is sent twice. The state is the newest step's 19 numbers; a chunk has 7 columns.
The links send it in the server's generic raw form: on OpenPI the embodiment's wire keys (`observation/image`,
`observation/wrist_image` as [H, W, 3] or [T, H, W, 3], `observation/state`), over HTTP the raw keys (`video.image`,
`video.wrist_image` [1, T, H, W, 3], `state.state` [1, 19]).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from dreamzero_client.errors import InvalidObservation
from dreamzero_droid.links import HttpLink, OpenPILink
from dreamzero_droid.policy import Chunk, SessionPolicy, as_call_error, validate_chunk
from dreamzero_franka.pnp.actions import ACTION_DIM
from dreamzero_franka.pnp.observation import STATE_DIM, WIRE_IMAGE, WIRE_STATE, WIRE_WRIST

#: OpenPI wire key -> the raw form's key (the server's franka_pnp `openpi_key_map`, reversed)
RAW_KEYS = {WIRE_IMAGE: "video.image", WIRE_WRIST: "video.wrist_image", WIRE_STATE: "state.state"}


def frame_offsets(executed_rows: int) -> tuple[int, ...]:
    """The 4 steps (relative to the current one) of a continuing query's frames, evenly over the executed rows."""
    if executed_rows < 4:
        raise ValueError(f"executed_rows must be >= 4 (one frame per 4-frame block slot), got {executed_rows}")
    return tuple(-((executed_rows * (3 - i)) // 4) for i in range(4))


@dataclass(frozen=True)
class PnpQuery:
    """One franka_pnp query: the frames to send, the newest state, and the session's continuity fields."""

    session_id: str
    prompt: str
    observation: dict  # WIRE_IMAGE / WIRE_WRIST uint8 (H, W, 3) or (T, H, W, 3), WIRE_STATE float32 (19,)
    first_call: bool
    expected_step: int | None = None
    expected_incarnation: str | None = None
    # the fleet's fields (docs/fleet.md), set by the control loop (`fleet_fields`); None: not sent
    observed_at: float | None = None
    traffic_class: str | None = None
    deadline_ms: float | None = None
    # the links send a query's RTC fields: franka_pnp queries never ask for real-time chunking (its loop executes
    # whole chunks), so there are none
    rtc: ClassVar[None] = None


def check_observation(obs: dict) -> dict:
    """The three wire arrays of `obs` (as `PnpObservationBuilder.build` returns them), checked; errors name the key."""
    if not isinstance(obs, dict):
        raise InvalidObservation(f"observation must be a dict, got {type(obs).__name__}", field="observation")
    out = {}
    for key in (WIRE_IMAGE, WIRE_WRIST):
        img = obs.get(key)
        if not (isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3):
            raise InvalidObservation(f"{key}: expected a uint8 (H, W, 3) image, got {getattr(img, 'shape', img)}", key)
        out[key] = img
    state = np.asarray(obs.get(WIRE_STATE, np.zeros(0)), dtype=np.float32)
    if state.shape != (STATE_DIM,) or not np.all(np.isfinite(state)):
        raise InvalidObservation(f"{WIRE_STATE}: expected {STATE_DIM} finite numbers, got {state.shape}", WIRE_STATE)
    out[WIRE_STATE] = state
    return out


class PnpOpenPILink(OpenPILink):
    """The OpenPI WebSocket link with franka_pnp's observation keys (the server maps them through its embodiment);
    the rest of the message (prompt, session, continuity fields) and the transport are `OpenPILink`'s."""

    def openpi_observation(self, query: PnpQuery) -> dict:
        return dict(query.observation)


class PnpHttpLink(HttpLink):
    """`POST /v1/actions/generations`, raw form, one row: views [1, T, H, W, 3], state [1, 19]; the request, its
    timeouts and retries are `HttpLink`'s."""

    def raw_observation(self, query: PnpQuery) -> dict:
        obs = query.observation
        frames = lambda img: img[None, None] if img.ndim == 3 else img[None]  # noqa: E731 -> [1, T, H, W, 3]
        return {
            RAW_KEYS[WIRE_IMAGE]: frames(obs[WIRE_IMAGE]),
            RAW_KEYS[WIRE_WRIST]: frames(obs[WIRE_WRIST]),
            RAW_KEYS[WIRE_STATE]: obs[WIRE_STATE][None],
        }


class PnpPolicy(SessionPolicy):
    """One franka_pnp session at a time over a link whose `send` takes a `PnpQuery` (the two links above)."""

    action_dim = ACTION_DIM

    def __init__(
        self,
        link,
        prompt: str | None = None,
        min_rows: int = 1,
        session_prefix: str = "franka-pnp",
        offsets: tuple[int, ...] = frame_offsets(12),
    ):
        self.set_frame_offsets(offsets)
        super().__init__(link, prompt=prompt, min_rows=min_rows, session_prefix=session_prefix)

    def set_frame_offsets(self, offsets: tuple[int, ...]) -> None:
        if len(offsets) != 4 or offsets[-1] != 0 or list(offsets) != sorted(set(offsets)):
            raise ValueError(f"frame offsets must be 4 increasing steps ending at 0, got {offsets}")
        self.frame_offsets = tuple(offsets)
        self._frames: deque[dict] = deque(maxlen=1 - offsets[0])

    def _new_session(self) -> None:
        super()._new_session()
        self._frames.clear()

    def observe(self, obs: dict) -> None:
        """Record a control step that does not query (a later query's 4-frame block needs it)."""
        arrays = check_observation(obs)
        with self._lock:
            self._frames.append(arrays)

    def request(self, obs: dict) -> PnpQuery:
        prompt = obs.get("prompt", self.prompt) if isinstance(obs, dict) else self.prompt
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidObservation("prompt: expected a non-empty instruction", field="prompt")
        arrays = check_observation(obs)
        with self._lock:
            self._frames.append(arrays)
            first = self.calls == 0
            self.calls += 1
            if first:
                message = arrays
            else:
                last = len(self._frames) - 1
                picked = [self._frames[max(0, last + off)] for off in self.frame_offsets]
                message = {key: np.stack([f[key] for f in picked]) for key in (WIRE_IMAGE, WIRE_WRIST)}
                message[WIRE_STATE] = arrays[WIRE_STATE]
            return PnpQuery(self.session_id, prompt, message, first, self._last_step, self._last_incarnation)

    def send(self, query: PnpQuery) -> Chunk:
        start = time.perf_counter()
        try:
            reply = self.link.send(query)
        except Exception as exc:  # translated, never swallowed: the caller ends the episode with the reason
            raise as_call_error(exc) from exc
        latency_ms = (time.perf_counter() - start) * 1e3
        actions = validate_chunk(reply.actions, action_dim=self.action_dim, min_rows=self.min_rows)
        restarted = self._continuity(query, reply.session)
        return Chunk(actions, latency_ms, query.session_id, reply.session, dict(reply.timings or {}), restarted)
