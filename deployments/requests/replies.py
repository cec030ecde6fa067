"""The HTTP door's reply: `build_response` writes a `GenerationRequest`'s actions, session reports, timings and video
in the request's `response_format`. Server-side only; a client reads replies with
`dreamzero_client.wire.replies.parse_actions_response`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from deployments.requests.generations import GenerationRequest
from deployments.requests.rows import RowOptions
from dreamzero.types import SessionReport

#: where a reply's `observed_at` came from: the client's own field, or the server's receive time (none was sent)
OBSERVED_AT_SOURCES = ("client", "server")


def row_echo(rows: RowOptions, replied_at: float | None = None) -> list[dict]:
    """What each row's session report adds (docs/fleet.md), so a client can tell how old the observation behind a
    chunk is: `observed_at` (the client's value echoed unchanged, else the server's receive time, unix seconds),
    `observed_at_source`, `server_ms` (the door received the request -> this reply, ms) and `traffic_class` (the
    class the row was served as). `rows`: as the graph runner served them (classes resolved)."""
    rows = rows.with_classes()
    now = time.time() if replied_at is None else replied_at
    server_ms = round(max(0.0, now - rows.received_at) * 1000.0, 3)
    observed = rows.observed_at or [None] * len(rows)
    return [
        {
            "observed_at": rows.received_at if t is None else t,
            "observed_at_source": "server" if t is None else "client",
            "server_ms": server_ms,
            "traffic_class": c,
        }
        for t, c in zip(observed, rows.traffic_class)
    ]


def session_dicts(sessions: Sequence[SessionReport | Mapping], echo: Sequence[Mapping] | None = None) -> list[dict]:
    """The per-row session reports as sent, each with its row's echo (`row_echo`) when given."""
    out = [s.to_dict() if isinstance(s, SessionReport) else dict(s) for s in sessions]
    for report, extra in zip(out, echo or ()):
        report.update(extra)
    return out


def build_response(
    request: GenerationRequest,
    actions: np.ndarray,
    sessions: Sequence[SessionReport | Mapping],
    timings_ms: Mapping[str, float] | None = None,
    usage: Mapping[str, Any] | None = None,
    video: np.ndarray | None = None,
    echo: Sequence[Mapping] | None = None,
) -> dict:
    """The reply for `request` in its `response_format` (sglang envelope or raw); `video` uint8 [B, T, H, W, 3]
    (a `runtime.return_video` request) goes beside the actions as `data[0].video` / `video`; each session report
    carries its row's `echo` (default: `row_echo` of the request's rows, now)."""
    actions = np.ascontiguousarray(actions, dtype=np.float32)
    if actions.ndim != 3 or actions.shape[0] != request.batch_size:
        raise ValueError(f"actions must be [B={request.batch_size}, H, D], got {list(actions.shape)}")
    if len(sessions) != request.batch_size:
        raise ValueError(f"need one session report per row ({request.batch_size}), got {len(sessions)}")
    values: Any = actions if request.output_format == "numpy" else actions.tolist()
    extras = {
        "sessions": session_dicts(sessions, row_echo(request.rows) if echo is None else echo),
        "timings": {k: float(v) for k, v in (timings_ms or {}).items()},
        "form": request.form,
    }
    if request.response_format == "raw":
        params: dict[str, Any] = {"session_ids": list(request.session_ids), "reset_mask": list(request.rows.reset_mask)}
        if request.rows.seeds is not None:
            params["seeds"] = list(request.rows.seeds)
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


def _new_id() -> str:
    return f"act_{uuid.uuid4().hex}"
