"""The HTTP door's decoder: a decoded `POST /v1/actions/generations` body -> the typed `GenerationRequest` (its
observation in either form, its per-row options as one `RowOptions`). Server-side only: a client builds bodies with
`dreamzero_client.wire.generations.build_request_body`, whose constants (forms, bounds) this module reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments.requests import fields as f
from deployments.requests.rows import RowOptions
from dreamzero.errors import InvalidObservation
from dreamzero_client.wire import codec
from dreamzero_client.wire.generations import _FORM_ALIASES, FORMS, OUTPUT_FORMATS, RESPONSE_FORMATS

#: observation keys of the normalised form (RLinf's DreamZero adapter); the first three decide the form
NORMALISED_KEYS = ("images", "state", "state_mask")
NORMALISED_OPTIONAL_KEYS = ("embodiment_id", "has_lapa_action", "is_cotrain_instance")
#: frames per row of a normalised `images` tensor: 1 (single frame) or a 4-frame stack
NORMALISED_FRAME_COUNTS = (1, 4)
DEFAULT_MAX_STATE_DIM = 64


def infer_form(observation: Mapping) -> str:
    """``"normalised"`` when the observation carries `images`, `state` or `state_mask`, else ``"raw"``."""
    return "normalised" if any(k in observation for k in NORMALISED_KEYS) else "raw"


# 1. The typed request ----------------------------------------------------------------------------------------------


@dataclass
class GenerationRequest:
    """A validated request for B sessions (one row per session), whichever door decoded it."""

    observation: dict[str, np.ndarray]  # normalised: images/state/state_mask[/...]; raw: the embodiment's keys
    rows: RowOptions  # prompts, session ids, reset and every other per-row option
    form: str = "raw"  # "normalised" | "raw"
    routing_key: str | None = None
    response_format: str = "envelope"
    output_format: str = "numpy"
    model: str | None = None
    flavour: str = codec.OPENPI  # codec flavour the body arrived in; replies use the same

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def session_ids(self) -> list[str]:
        return self.rows.session_ids

    @property
    def prompts(self) -> list[str]:
        return self.rows.prompts

    @property
    def return_video(self) -> bool:
        return self.rows.return_video

    @property
    def route_key(self) -> str:
        """Pins every session of the request to one replica: explicit `routing_key`, else the first session id."""
        return self.routing_key or self.rows.session_ids[0]


# 2. Observation validation ---------------------------------------------------------------------------------------


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


# 3. The request parser -------------------------------------------------------------------------------------------


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

    reset = params.get("reset_mask")
    reset_mask = None if reset is None else f.bools(reset, "parameters.reset_mask", b)
    negative = params.get("negative_prompts")
    negative_prompts = None if negative is None else f.strings(negative, "parameters.negative_prompts", b)
    rows = RowOptions.read(
        prompts, session_ids, reset_mask, params, "parameters.", runtime, "runtime.", negative_prompts
    )
    routing_key = params.get("routing_key")
    if routing_key is not None and (not isinstance(routing_key, str) or not routing_key):
        raise InvalidObservation("'parameters.routing_key' must be a non-empty string", field="parameters.routing_key")

    return GenerationRequest(
        observation=observation,
        rows=rows,
        form=form,
        routing_key=routing_key,
        response_format=f.choice(
            runtime.get("response_format", "envelope"), "runtime.response_format", RESPONSE_FORMATS
        ),
        output_format=f.choice(runtime.get("output_format", "numpy"), "runtime.output_format", OUTPUT_FORMATS),
        model=model,
        flavour=flavour,
    )
