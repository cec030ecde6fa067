"""Replies of `POST /v1/actions/generations`: the reply reader, the restart reasons of its per-session reports, and
error bodies (the server's reply builder: `deployments.requests.replies`; its report type: `dreamzero.types`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dreamzero_client.errors import InvalidRequest

#: a reply's `sessions` holds one report per row: session_id, step (chunks so far on this replica, 1 after a restart),
#: restarted, restart_reason (one of these, else None), frame_position, incarnation (echo it back), rtc (when asked)
RESTART_REASONS = (
    "new_session",  # never seen on this replica (first call, or it lived on a replica that died / scaled away)
    "reset_requested",  # reset_mask[i] was true, or an explicit reset
    "prompt_changed",  # the instruction differs from the session's cached one
    "single_frame",  # a 1-frame input after the first call (reference servers restart on it)
    "window_full",  # current_start_frame reached the attention window (after 4 chunks on DROID)
    "step_mismatch",  # the client's expected step (or incarnation) differs from the state this replica holds
    "evicted",  # the session was evicted (LRU/TTL) since its last call
)
#: what the server says about each session's RTC target (`session.rtc` in its reply; docs/rtc.md)
RTC_SOURCES = ("client_prefix", "session_cache", "cold_start")


def parse_video(entry: Any) -> np.ndarray | None:
    """A reply's `video` object -> uint8 [B, T, H, W, 3] (None when the reply has none)."""
    if entry is None:
        return None
    try:
        return np.asarray(entry["values"], dtype=np.uint8).reshape([int(s) for s in entry["shape"]])
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidRequest(f"reply video cannot be read as uint8 frames: {e}") from None


@dataclass
class ActionsReply:
    """A decoded actions reply as a client sees it."""

    actions: np.ndarray  # float32 [B, H, D]
    sessions: list[dict]
    timings: dict[str, float]
    form: str | None
    video: np.ndarray | None = None  # uint8 [B, T, H, W, 3] when the request asked for it (`return_video`)


def parse_actions_response(resp: Any) -> ActionsReply:
    """Actions out of an envelope (`data[0].action.values`) or a raw reply (`actions`); else `InvalidRequest`."""
    if not isinstance(resp, Mapping):
        raise InvalidRequest(f"reply must be an object, got {type(resp).__name__}")
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
