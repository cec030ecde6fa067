"""`POST /v1/actions/generations` requests as a client builds them: the body builder and the wire's constants (forms,
reply formats, bounds). The server's parser reads the same constants (`deployments.requests.generations`, which
also holds the normalised form's keys).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

FORMS = ("normalised", "raw")
RESPONSE_FORMATS = ("envelope", "raw")
OUTPUT_FORMATS = ("numpy", "list")

#: bounds of the real-time chunking fields (docs/rtc.md): counts of actions
MAX_RTC_ACTIONS = 1024
#: bounds of the continuity echoes: a session's step, and the length of its incarnation id
MAX_EXPECTED_STEP = 2**62
MAX_INCARNATION_LEN = 64
#: the traffic classes a request's rows may ask for (docs/fleet.md): a robot's `realtime` rows fill each model call
#: first, ordered by deadline; an evaluation farm's `batch` rows get the rest of it (and a floor)
TRAFFIC_CLASSES = ("realtime", "batch")
#: the longest `deadline_ms` a row may state (an hour: anything longer is no deadline)
MAX_DEADLINE_MS = 3_600_000.0

_FORM_ALIASES = {"normalised": "normalised", "normalized": "normalised", "raw": "raw"}
#: every spelling of `input.form` the parser accepts
FORM_NAMES = tuple(_FORM_ALIASES)


def build_request_body(
    observation: Mapping[str, Any],
    prompts: Sequence[str],
    session_ids: Sequence[str],
    *,
    form: str | None = None,
    reset_mask: Sequence[bool] | None = None,
    negative_prompts: Sequence[str] | None = None,
    seed: int | Sequence[int] | None = None,
    expected_steps: Sequence[int | None] | None = None,
    expected_incarnations: Sequence[str | None] | None = None,
    routing_key: str | None = None,
    model: str = "dreamzero",
    response_format: str = "envelope",
    output_format: str = "numpy",
    rtc_prefix_len: int | Sequence[int | None] | None = None,
    rtc_exec_horizon: int | Sequence[int | None] | None = None,
    action_prefix: Any = None,
    return_video: bool = False,
    traffic_class: str | Sequence[str] | None = None,
    deadline_ms: float | Sequence[float | None] | None = None,
    observed_at: float | Sequence[float | None] | None = None,
) -> dict:
    """The body `dreamzero_client.http_client` sends. The RTC and fleet fields (docs/rtc.md, docs/fleet.md) take one
    value or one per row; `return_video` and the fleet fields are sent only when set: other servers see today's body."""
    inp: dict[str, Any] = {"prompt": list(prompts), "observation": dict(observation)}
    if form is not None:
        inp["form"] = form
    params: dict[str, Any] = {"session_ids": list(session_ids)}
    for key, value in (
        ("reset_mask", reset_mask),
        ("negative_prompts", negative_prompts),
        ("expected_steps", expected_steps),
        ("expected_incarnations", expected_incarnations),
        ("routing_key", routing_key),
    ):
        if value is not None:
            params[key] = value if isinstance(value, str) else list(value)
    if seed is not None:
        params["seed"] = seed if isinstance(seed, int) else list(seed)
    for key, value in (("rtc_prefix_len", rtc_prefix_len), ("rtc_exec_horizon", rtc_exec_horizon)):
        if value is not None:
            params[key] = value if isinstance(value, (int, np.integer)) else list(value)
    if action_prefix is not None:
        is_array = isinstance(action_prefix, np.ndarray)
        params["action_prefix"] = action_prefix if is_array else [None if p is None else p for p in action_prefix]
    params.update(fleet_fields(traffic_class, deadline_ms, observed_at))
    runtime: dict[str, Any] = {"response_format": response_format, "output_format": output_format}
    if return_video:
        runtime["return_video"] = True
    return {"model": model, "input": inp, "parameters": params, "runtime": runtime}


def fleet_fields(traffic_class: Any = None, deadline_ms: Any = None, observed_at: Any = None) -> dict:
    """The fleet's fields that were given (docs/fleet.md), each one value for every row or one per row: `traffic_class`
    (TRAFFIC_CLASSES), `deadline_ms` (actions left / control rate, ms), `observed_at` (the client's own clock, s)."""
    given = {"traffic_class": traffic_class, "deadline_ms": deadline_ms, "observed_at": observed_at}
    return {key: value for key, value in given.items() if value is not None}
