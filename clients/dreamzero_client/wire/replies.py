"""Replies of `POST /v1/actions/generations`: per-session continuity reports, the reply builder (server) and the
reply reader (client), and error bodies.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dreamzero_client.errors import InvalidRequest
from dreamzero_client.wire import fields as f
from dreamzero_client.wire.generations import GenerationRequest

#: why a session (re)started; reported per session in every response
RESTART_REASONS = (
    "new_session",  # never seen on this replica (first call, or it lived on a replica that died / scaled away)
    "reset_requested",  # reset_mask[i] was true, or an explicit reset
    "prompt_changed",  # the instruction differs from the session's cached one
    "single_frame",  # a 1-frame input after the first call (reference servers restart on it)
    "window_full",  # current_start_frame reached the attention window (after 4 chunks on DROID)
    "step_mismatch",  # the client's expected step (or incarnation) differs from the state this replica holds
    "evicted",  # the session was evicted (LRU/TTL) since its last call
)


@dataclass
class SessionReport:
    """Per-session continuity report, returned for every row of every response."""

    session_id: str
    step: int  # number of chunks this session has produced on this replica, including this one (1 after a restart)
    restarted: bool  # True if the state was (re)started for this call
    restart_reason: str | None  # one of RESTART_REASONS when restarted, else None
    frame_position: int  # current_start_frame after this call (latent frames)
    incarnation: str | None = None  # random id of this session state, new at every (re)start; echo it back
    rtc: str | None = None  # real-time chunking: "client_prefix" | "session_cache" | "cold_start"; None = not asked

    def to_dict(self) -> dict:
        extra = {} if self.rtc is None else {"rtc": self.rtc}
        return {
            "session_id": self.session_id,
            "step": self.step,
            "restarted": self.restarted,
            "restart_reason": self.restart_reason,
            "frame_position": self.frame_position,
            "incarnation": self.incarnation,
            **extra,
        }


def _session_dicts(sessions: Sequence[SessionReport | Mapping]) -> list[dict]:
    return [s.to_dict() if isinstance(s, SessionReport) else dict(s) for s in sessions]


def build_response(
    request: GenerationRequest,
    actions: np.ndarray,
    sessions: Sequence[SessionReport | Mapping],
    timings_ms: Mapping[str, float] | None = None,
    usage: Mapping[str, Any] | None = None,
    video: np.ndarray | None = None,
) -> dict:
    """The reply for `request` in its `response_format` (sglang envelope or raw); `video` uint8 [B, T, H, W, 3]
    (a `runtime.return_video` request) goes beside the actions as `data[0].video` / `video`."""
    actions = np.ascontiguousarray(actions, dtype=np.float32)
    if actions.ndim != 3 or actions.shape[0] != request.batch_size:
        raise ValueError(f"actions must be [B={request.batch_size}, H, D], got {list(actions.shape)}")
    if len(sessions) != request.batch_size:
        raise ValueError(f"need one session report per row ({request.batch_size}), got {len(sessions)}")
    values: Any = actions if request.output_format == "numpy" else actions.tolist()
    extras = {
        "sessions": _session_dicts(sessions),
        "timings": {k: float(v) for k, v in (timings_ms or {}).items()},
        "form": request.form,
    }
    if request.response_format == "raw":
        params: dict[str, Any] = {"session_ids": list(request.session_ids), "reset_mask": list(request.reset_mask)}
        if request.seeds is not None:
            params["seeds"] = list(request.seeds)
        return {"request_id": _new_id(), "actions": values, "parameters": params, **_video(video, request), **extras}
    b, h, d = actions.shape
    return {
        "id": _new_id(),
        "object": "action.generation",
        "created": int(time.time()),
        "model": request.model or "dreamzero",
        "data": [
            {
                "index": 0,
                "input_index": 0,
                "candidate_index": 0,
                "action": {"type": "continuous", "dtype": "float32", "shape": [b, h, d], "values": values},
                **_video(video, request),
            }
        ],
        "usage": dict(usage) if usage is not None else {"batch_size": b, "action_horizon": h, "action_dim": d},
        **extras,
    }


def _video(video: np.ndarray | None, request: GenerationRequest) -> dict:
    """`{"video": {...}}` for a reply that carries predicted frames, else nothing (replies stay as they were)."""
    if video is None:
        return {}
    video = np.ascontiguousarray(video, dtype=np.uint8)
    if video.ndim != 5 or video.shape[0] != request.batch_size or video.shape[-1] != 3:
        raise ValueError(f"video must be uint8 [B={request.batch_size}, T, H, W, 3], got {list(video.shape)}")
    values: Any = video if request.output_format == "numpy" else video.tolist()
    return {"video": {"type": "rgb", "dtype": "uint8", "shape": list(video.shape), "values": values}}


def parse_video(entry: Any) -> np.ndarray | None:
    """A reply's `video` object -> uint8 [B, T, H, W, 3] (None when the reply has none)."""
    if entry is None:
        return None
    try:
        return np.asarray(entry["values"], dtype=np.uint8).reshape([int(s) for s in entry["shape"]])
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidRequest(f"reply video cannot be read as uint8 frames: {e}") from None


def _new_id() -> str:
    return f"act_{uuid.uuid4().hex}"


@dataclass
class ActionsReply:
    """A decoded actions reply as a client sees it."""

    actions: np.ndarray  # float32 [B, H, D]
    sessions: list[dict]
    timings: dict[str, float]
    form: str | None
    video: np.ndarray | None = None  # uint8 [B, T, H, W, 3] when the request asked for it (`return_video`)


def parse_actions_response(resp: Any) -> ActionsReply:
    """Read actions out of an envelope (`data[0].action.values`) or a raw reply (`actions`).

    Raises `InvalidRequest` (the reply does not follow the protocol) naming the missing path.
    """
    if not isinstance(resp, Mapping):
        raise InvalidRequest(f"reply must be an object, got {f.type_name(resp)}")
    if "data" in resp:
        try:
            action = resp["data"][0]["action"]
            values = action["values"]
        except (KeyError, IndexError, TypeError):
            raise InvalidRequest("envelope reply has no 'data[0].action.values'") from None
        shape = action.get("shape")
        video = parse_video(resp["data"][0].get("video"))
    elif "actions" in resp:
        values, shape = resp["actions"], None
        video = parse_video(resp.get("video"))
    else:
        raise InvalidRequest(f"reply has neither 'data' nor 'actions' (keys: {sorted(resp)[:10]})")
    try:
        actions = np.asarray(values, dtype=np.float32)
        if shape is not None:
            actions = actions.reshape([int(s) for s in shape])
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"reply actions cannot be read as a float32 array of shape {shape}: {e}") from None
    sessions = resp.get("sessions") or []
    timings = dict(resp.get("timings") or {})
    return ActionsReply(actions, [dict(s) for s in sessions], timings, resp.get("form"), video)


def error_body(code: str, message: str, field: str | None = None) -> dict:
    """HTTP error reply body: structured `error` plus FastAPI/sglang-style `detail` (see deployments.error_replies)."""
    err = {"code": code, "message": message}
    if field is not None:
        err["field"] = field
    return {"error": err, "detail": message}


def parse_error_body(body: Any) -> tuple[str | None, str, str | None]:
    """``(code, message, field)`` from any error reply: ours, FastAPI's ``{"detail": ...}``, or plain text."""
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping):
            return err.get("code"), str(err.get("message", "")), err.get("field")
        detail = body.get("detail", body.get("message"))
        if isinstance(detail, list) and detail and isinstance(detail[0], Mapping):  # FastAPI validation errors
            first = detail[0]
            loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
            return None, str(first.get("msg", detail)), loc
        if detail is not None:
            return None, str(detail), None
        return None, str(dict(body)), None
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    return None, str(body).strip(), None
