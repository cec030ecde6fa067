"""`POST /v1/actions/generations` requests: the typed request, validation of both forms, the parser and the
client-side builder. The same code checks a request on the client before sending and on the server on arrival.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dreamzero_client.errors import InvalidObservation
from dreamzero_client.wire import codec
from dreamzero_client.wire import fields as f

FORMS = ("normalised", "raw")
RESPONSE_FORMATS = ("envelope", "raw")
OUTPUT_FORMATS = ("numpy", "list")

#: observation keys of the normalised form (RLinf's DreamZero adapter); the first three decide the form
NORMALISED_KEYS = ("images", "state", "state_mask")
NORMALISED_OPTIONAL_KEYS = ("embodiment_id", "has_lapa_action", "is_cotrain_instance")
#: frames per row of a normalised `images` tensor: 1 (single frame) or a 4-frame stack
NORMALISED_FRAME_COUNTS = (1, 4)
DEFAULT_MAX_STATE_DIM = 64
#: bounds of the real-time chunking fields (docs/rtc.md): counts of actions, and the widest action vector
MAX_RTC_ACTIONS = 1024
MAX_ACTION_DIM = 32
#: bounds of the continuity echoes: a session's step, and the length of its incarnation id
MAX_EXPECTED_STEP = 2**62
MAX_INCARNATION_LEN = 64

_FORM_ALIASES = {"normalised": "normalised", "normalized": "normalised", "raw": "raw"}
#: every spelling of `input.form` the parser accepts
FORM_NAMES = tuple(_FORM_ALIASES)


def infer_form(observation: Mapping) -> str:
    """``"normalised"`` when the observation carries `images`, `state` or `state_mask`, else ``"raw"``."""
    return "normalised" if any(k in observation for k in NORMALISED_KEYS) else "raw"


# 1. The typed request ----------------------------------------------------------------------------------------------


@dataclass
class GenerationRequest:
    """A validated `POST /v1/actions/generations` body for B sessions (one row per session)."""

    prompts: list[str]  # B
    observation: dict[str, np.ndarray]  # normalised: images/state/state_mask[/...]; raw: the embodiment's keys
    session_ids: list[str]  # B unique, non-empty
    form: str = "raw"  # "normalised" | "raw"
    reset_mask: list[bool] = field(default_factory=list)  # B (all False when not sent)
    negative_prompts: list[str] | None = None
    seeds: list[int] | None = None  # per row; `parameters.seed` may be one int (broadcast) or B ints
    expected_steps: list[int | None] | None = None
    expected_incarnations: list[str | None] | None = None  # per row: `incarnation` of the last reply's session
    routing_key: str | None = None
    response_format: str = "envelope"
    output_format: str = "numpy"
    model: str | None = None
    flavour: str = codec.OPENPI  # codec flavour the body arrived in; replies use the same
    # real-time chunking (docs/rtc.md), per row; None = not asked. action_prefix rows are [P, D] float64 in robot
    # units (raw form) or normalised units (normalised form)
    rtc_prefix_len: list[int | None] | None = None
    rtc_exec_horizon: list[int | None] | None = None
    action_prefix: list[np.ndarray | None] | None = None
    # `runtime.return_video`: the reply also carries each row's predicted frames, uint8 [B, T, H, W, 3]
    return_video: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.session_ids)

    @property
    def route_key(self) -> str:
        """Pins every session of the request to one replica: explicit `routing_key`, else the first session id."""
        return self.routing_key or self.session_ids[0]


# 3. Observation validation ---------------------------------------------------------------------------------------


def validate_normalised(observation: Mapping, b: int, max_state_dim: int = DEFAULT_MAX_STATE_DIM) -> dict:
    """Check the RLinf normalised form; returns arrays with the canonical dtypes and shapes.

    images uint8 [B,T,H,W,3] (T in 1|4; [B,H,W,3] is read as T=1), state float32 [B,1,D] and state_mask bool
    [B,1,D] with D = max_state_dim ([B,D] accepted), embodiment_id int64 [B], has_lapa_action/is_cotrain_instance
    bool [B] (accepted, unused).
    """
    allowed = NORMALISED_KEYS + NORMALISED_OPTIONAL_KEYS
    extra = sorted(set(observation) - set(allowed))
    if extra:
        key = f"{f.OBSERVATION}.{extra[0]}"
        raise InvalidObservation(
            f"'{key}' is not a key of the normalised form (allowed: {list(allowed)}); raw embodiment keys cannot be "
            "mixed with images/state/state_mask",
            field=key,
        )
    for k in NORMALISED_KEYS:
        if k not in observation:
            raise InvalidObservation(
                f"'{f.OBSERVATION}.{k}' is required in the normalised form", field=f"{f.OBSERVATION}.{k}"
            )
    out: dict[str, np.ndarray] = {}

    # images: uint8 [B, T, H, W, 3]
    name = f"{f.OBSERVATION}.images"
    img = f.array(observation["images"], name)
    if img.ndim == 4:
        img = img[:, None]
    if img.ndim != 5 or img.shape[0] != b or img.shape[1] not in NORMALISED_FRAME_COUNTS or img.shape[-1] != 3:
        raise InvalidObservation(
            f"'{name}' must have shape [B={b}, T in {list(NORMALISED_FRAME_COUNTS)}, H, W, 3], got {list(img.shape)}",
            field=name,
        )
    if img.shape[2] == 0 or img.shape[3] == 0:
        raise InvalidObservation(f"'{name}' has an empty frame: shape {list(img.shape)}", field=name)
    if img.dtype != np.uint8:
        # JSON lists arrive as int64: accept any integer array whose values fit in uint8
        if img.dtype.kind not in "iu" or (img.size and (img.min() < 0 or img.max() > 255)):
            raise InvalidObservation(f"'{name}' must be uint8 pixels in [0, 255], got dtype {img.dtype}", field=name)
        img = img.astype(np.uint8)
    out["images"] = img

    # state: float32 [B, 1, D]; state_mask: bool [B, 1, D]
    for key, kinds in (("state", "fiu"), ("state_mask", "bui")):
        name = f"{f.OBSERVATION}.{key}"
        arr = f.array(observation[key], name)
        if arr.ndim == 2:
            arr = arr[:, None]
        if arr.shape != (b, 1, max_state_dim):
            raise InvalidObservation(
                f"'{name}' must have shape [B={b}, 1, {max_state_dim}], got {list(arr.shape)}", field=name
            )
        if arr.dtype.kind not in kinds:
            want = "float32" if key == "state" else "bool"
            raise InvalidObservation(f"'{name}' must be {want}, got dtype {arr.dtype}", field=name)
        if key == "state":
            arr = arr.astype(np.float32, copy=False)
            if not np.isfinite(arr).all():
                raise InvalidObservation(f"'{name}' holds NaN or infinite values", field=name)
        else:
            if arr.dtype.kind != "b" and not np.isin(arr, (0, 1)).all():
                raise InvalidObservation(f"'{name}' must hold booleans (0/1), got other values", field=name)
            arr = arr.astype(bool, copy=False)
        out[key] = arr

    # optional per-row vectors
    for key, dtype, kinds in (
        ("embodiment_id", np.int64, "iu"),
        ("has_lapa_action", np.bool_, "bui"),
        ("is_cotrain_instance", np.bool_, "bui"),
    ):
        if key not in observation:
            continue
        name = f"{f.OBSERVATION}.{key}"
        arr = f.array(observation[key], name)
        if arr.ndim == 0:
            arr = np.full((b,), arr.item())
        if arr.shape != (b,) or arr.dtype.kind not in kinds:
            raise InvalidObservation(
                f"'{name}' must be {np.dtype(dtype).name} [B={b}], got {f.type_name(arr)}", field=name
            )
        out[key] = arr.astype(dtype, copy=False)
    return out


def validate_raw(observation: Mapping, b: int) -> dict[str, np.ndarray]:
    """Structure only (the embodiment checks keys, shapes and dtypes): arrays with a leading batch dim of B."""
    if not observation:
        raise InvalidObservation(
            f"'{f.OBSERVATION}' is empty; send the embodiment's observation keys", field=f.OBSERVATION
        )
    out = {}
    for key, v in observation.items():
        name = f"{f.OBSERVATION}.{key}"
        if not key:
            raise InvalidObservation(f"'{f.OBSERVATION}' holds an empty key", field=f.OBSERVATION)
        arr = f.array(v, name)
        if arr.ndim == 0 or arr.shape[0] != b:
            raise InvalidObservation(
                f"'{name}' must have a leading batch dimension of {b} (one row per session), got shape "
                f"{list(arr.shape)}",
                field=name,
            )
        out[key] = arr
    return out


# 4. Real-time chunking fields -------------------------------------------------------------------------------------


def rtc_counts(v: Any, name: str, b: int) -> list[int | None] | None:
    """`rtc_prefix_len` / `rtc_exec_horizon`: null, one count for every row, or B entries of a count or null."""
    if v is None:
        return None
    rows = f.per_row(v, name, b, (int,))
    return [None if x is None else f.int_in(x, f"{name}[{i}]", 0, MAX_RTC_ACTIONS) for i, x in enumerate(rows)]


def _prefix_row(v: Any, name: str) -> np.ndarray:
    arr = f.array(v, name)
    if arr.dtype.kind not in "fiu":
        raise InvalidObservation(f"'{name}' must hold numbers, got dtype {arr.dtype}", field=name)
    if arr.ndim != 2 or not 1 <= arr.shape[0] <= MAX_RTC_ACTIONS or not 1 <= arr.shape[1] <= MAX_ACTION_DIM:
        raise InvalidObservation(
            f"'{name}' must be [P, D] actions (1 <= P <= {MAX_RTC_ACTIONS}, 1 <= D <= {MAX_ACTION_DIM}), "
            f"got shape {list(arr.shape)}",
            field=name,
        )
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise InvalidObservation(f"'{name}' holds NaN or infinite values", field=name)
    return arr


def action_prefixes(v: Any, name: str, b: int) -> list[np.ndarray | None] | None:
    """`action_prefix`: null, [P, D] for every row, [B, P, D], or B entries of [P, D] or null."""
    if v is None:
        return None
    rows = v if isinstance(v, np.ndarray) else f.as_list(v, name)
    if any(r is None for r in rows) or (len(rows) and not np.isscalar(rows[0]) and np.ndim(rows[0]) == 2):
        pass  # one entry per row (equal lengths or not)
    else:
        arr = _prefix_row(v, name)  # [P, D], the same prefix for every row
        return [arr] * b
    if len(rows) != b:
        raise InvalidObservation(f"'{name}' has {len(rows)} rows but the request has {b} sessions", field=name)
    return [None if r is None else _prefix_row(r, f"{name}[{i}]") for i, r in enumerate(rows)]


# 5. The request parser -------------------------------------------------------------------------------------------


def parse_generation_request(
    body: Any, flavour: str = codec.OPENPI, max_batch: int | None = None, max_state_dim: int = DEFAULT_MAX_STATE_DIM
) -> GenerationRequest:
    """Validate a decoded `POST /v1/actions/generations` body (docs/wire-protocol.md, section 2)."""
    body = f.mapping(body, "<body>")
    inp = f.mapping(body.get("input"), "input")
    params = f.mapping(body.get("parameters"), "parameters", required=False)
    runtime = f.mapping(body.get("runtime"), "runtime", required=False)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidObservation(f"'model' must be a string, got {f.type_name(model)}", field="model")

    # sessions define B; every per-row field must agree with it
    session_ids = f.session_ids_field(params.get("session_ids"))
    b = len(session_ids)
    if max_batch is not None and b > max_batch:
        raise InvalidObservation(
            f"'parameters.session_ids' holds {b} sessions; this server accepts at most {max_batch} per request",
            field="parameters.session_ids",
        )
    if "prompt" not in inp:
        raise InvalidObservation("'input.prompt' is required: one instruction per row", field="input.prompt")
    prompts = f.strings(inp["prompt"], "input.prompt", b)

    obs_raw = inp.get("observation")
    if not isinstance(obs_raw, Mapping):
        raise InvalidObservation(
            f"'{f.OBSERVATION}' must be an object, got {f.type_name(obs_raw)}", field=f.OBSERVATION
        )
    obs = f.flatten(obs_raw)
    form = f.choice(inp["form"], "input.form", FORMS, _FORM_ALIASES) if inp.get("form") is not None else infer_form(obs)
    observation = validate_normalised(obs, b, max_state_dim) if form == "normalised" else validate_raw(obs, b)

    reset_mask = (
        f.bools(params["reset_mask"], "parameters.reset_mask", b)
        if params.get("reset_mask") is not None
        else [False] * b
    )
    negative = params.get("negative_prompts")
    negative_prompts = None if negative is None else f.strings(negative, "parameters.negative_prompts", b)
    seeds = None
    if params.get("seed") is not None:
        seed = params["seed"]
        if isinstance(seed, (list, tuple, np.ndarray)):
            seeds = [
                f.int_in(s, f"parameters.seed[{i}]", 0, f.MAX_SEED)
                for i, s in enumerate(f.per_row(seed, "parameters.seed", b, ()))
            ]
        else:
            seeds = [f.int_in(seed, "parameters.seed", 0, f.MAX_SEED)] * b
    expected_steps, expected_incarnations = continuity_fields(params, b, "parameters.")
    rtc_prefix_len = rtc_counts(params.get("rtc_prefix_len"), "parameters.rtc_prefix_len", b)
    rtc_exec_horizon = rtc_counts(params.get("rtc_exec_horizon"), "parameters.rtc_exec_horizon", b)
    action_prefix = action_prefixes(params.get("action_prefix"), "parameters.action_prefix", b)
    routing_key = params.get("routing_key")
    if routing_key is not None and (not isinstance(routing_key, str) or not routing_key):
        raise InvalidObservation("'parameters.routing_key' must be a non-empty string", field="parameters.routing_key")

    return GenerationRequest(
        prompts=prompts,
        observation=observation,
        session_ids=session_ids,
        form=form,
        reset_mask=reset_mask,
        negative_prompts=negative_prompts,
        seeds=seeds,
        expected_steps=expected_steps,
        expected_incarnations=expected_incarnations,
        routing_key=routing_key,
        response_format=f.choice(
            runtime.get("response_format", "envelope"), "runtime.response_format", RESPONSE_FORMATS
        ),
        output_format=f.choice(runtime.get("output_format", "numpy"), "runtime.output_format", OUTPUT_FORMATS),
        model=model,
        flavour=flavour,
        rtc_prefix_len=rtc_prefix_len,
        rtc_exec_horizon=rtc_exec_horizon,
        action_prefix=action_prefix,
        return_video=f.flag(runtime.get("return_video", False), "runtime.return_video"),
    )


def continuity_fields(params: Mapping, b: int, prefix: str = "") -> tuple[list | None, list | None]:
    """`expected_steps` (ints) and `expected_incarnations` (strings) of B rows, each None when not sent.

    A client echoes the `step` and `incarnation` of each session's last reply so the server can tell stale state.
    """
    expected_steps = None
    if params.get("expected_steps") is not None:
        raw_steps = f.per_row(params["expected_steps"], f"{prefix}expected_steps", b, (int,))
        expected_steps = [
            None if s is None else f.int_in(s, f"{prefix}expected_steps[{i}]", 0, MAX_EXPECTED_STEP)
            for i, s in enumerate(raw_steps)
        ]
    expected_incarnations = None
    if params.get("expected_incarnations") is not None:
        raw_inc = f.per_row(params["expected_incarnations"], f"{prefix}expected_incarnations", b, (str,))
        for i, inc in enumerate(raw_inc):
            if inc is not None and (not isinstance(inc, str) or not 0 < len(inc) <= MAX_INCARNATION_LEN):
                raise InvalidObservation(
                    f"'{prefix}expected_incarnations[{i}]' must be null or the 'incarnation' string of the last "
                    f"reply for that session, got {inc!r}",
                    field=f"{prefix}expected_incarnations[{i}]",
                )
        expected_incarnations = list(raw_inc)
    return expected_steps, expected_incarnations


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
) -> dict:
    """The client side of `parse_generation_request` (what `clients.http_client` sends).

    Real-time chunking (docs/rtc.md): `rtc_prefix_len` d and `rtc_exec_horizon` s, one int or one per row;
    `action_prefix` [P, D] (every row), [B, P, D] or B entries of [P, D] / None. `return_video`: the reply also
    carries the predicted frames (sent only when set, so other servers see today's body).
    """
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
    runtime: dict[str, Any] = {"response_format": response_format, "output_format": output_format}
    if return_video:
        runtime["return_video"] = True
    return {"model": model, "input": inp, "parameters": params, "runtime": runtime}
