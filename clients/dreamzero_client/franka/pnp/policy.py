"""The franka_pnp client policy: `DroidPolicy`'s interface and session rules over franka_pnp's observation.

    policy = PnpPolicy(PnpOpenPILink("ws://gpu-box:8000"), prompt="put the red block in the bin")
    chunk = policy.infer(builder.build(exterior, wrist, tcp, closure, prompt))  # -> Chunk(actions float64 [H, 7])
    policy.reset()   # release the session on the server; a new session id
    policy.close()

Session id, continuity fields (the last reply's step / incarnation go back with the next query) and the failure
classification are `DroidPolicy`'s. What differs: a query carries one observation (the two views of this control
step and the 19-number state, as RLinf's real-world env hands its DreamZero policy one step at a time), not a frame
history, and a chunk has 7 columns. The links send it in the server's generic raw form: on OpenPI the embodiment's
wire keys (`observation/image`, `observation/wrist_image`, `observation/state`), over HTTP the raw keys
(`video.image`, `video.wrist_image`, `state.state`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dreamzero_client.errors import InvalidObservation
from dreamzero_client.franka.pnp.actions import ACTION_DIM
from dreamzero_client.franka.pnp.observation import STATE_DIM, WIRE_IMAGE, WIRE_STATE, WIRE_WRIST
from dreamzero_client.links import HttpLink, OpenPILink
from dreamzero_client.policy import Chunk, DroidPolicy, as_call_error, validate_chunk

#: OpenPI wire key -> the raw form's key (the server's franka_pnp `openpi_key_map`, reversed)
RAW_KEYS = {WIRE_IMAGE: "video.image", WIRE_WRIST: "video.wrist_image", WIRE_STATE: "state.state"}


@dataclass(frozen=True)
class PnpQuery:
    """One franka_pnp query: this step's observation and the session's continuity fields."""

    session_id: str
    prompt: str
    observation: dict  # WIRE_IMAGE / WIRE_WRIST uint8 (H, W, 3), WIRE_STATE float32 (19,)
    first_call: bool
    expected_step: int | None = None
    expected_incarnation: str | None = None


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
    """The OpenPI WebSocket link with franka_pnp's message (the server maps the keys through its embodiment)."""

    def message(self, query: PnpQuery) -> dict:
        msg = dict(query.observation)
        msg.update(prompt=query.prompt, session_id=query.session_id, response_format="dict")
        if self.echo_continuity and not query.first_call:
            if query.expected_step is not None:
                msg["expected_steps"] = [query.expected_step]
            if query.expected_incarnation is not None:
                msg["expected_incarnations"] = [query.expected_incarnation]
        return msg


class PnpHttpLink(HttpLink):
    """`POST /v1/actions/generations`, raw form, one row: views [1, 1, H, W, 3], state [1, 19]."""

    def raw_observation(self, query: PnpQuery) -> dict:
        obs = query.observation
        return {
            RAW_KEYS[WIRE_IMAGE]: obs[WIRE_IMAGE][None, None],
            RAW_KEYS[WIRE_WRIST]: obs[WIRE_WRIST][None, None],
            RAW_KEYS[WIRE_STATE]: obs[WIRE_STATE][None],
        }

    def send(self, query: PnpQuery):
        from dreamzero_client.policy import LinkReply

        result = self.client.generate(
            self.raw_observation(query),
            query.prompt,
            query.session_id,
            form="raw",
            expected_steps=[None if query.first_call else query.expected_step],
            expected_incarnations=[None if query.first_call else query.expected_incarnation],
        )
        sessions = result.sessions or [None]
        return LinkReply(result.actions[0], sessions[0], dict(result.timings or {}))


class PnpPolicy(DroidPolicy):
    """One franka_pnp session at a time over a link whose `send` takes a `PnpQuery` (the two links above)."""

    action_dim = ACTION_DIM

    def __init__(self, link, prompt: str | None = None, min_rows: int = 1, session_prefix: str = "franka-pnp"):
        super().__init__(link, prompt=prompt, min_rows=min_rows, session_prefix=session_prefix)

    def observe(self, obs: dict) -> None:
        """Nothing to record: a franka_pnp query carries only its own step (kept for the loop's common interface)."""

    def request(self, obs: dict) -> PnpQuery:
        prompt = obs.get("prompt", self.prompt) if isinstance(obs, dict) else self.prompt
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidObservation("prompt: expected a non-empty instruction", field="prompt")
        arrays = check_observation(obs)
        with self._lock:
            first = self.calls == 0
            self.calls += 1
            return PnpQuery(self.session_id, prompt, arrays, first, self._last_step, self._last_incarnation)

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
