"""Wire protocol of `POST /v1/actions/generations` and of the OpenPI WebSocket, shared by server and clients.

Ray-free and torch-free: numpy, msgpack and `dreamzero.errors`/`dreamzero.types` only. The byte-level codec lives
in `serve_graph.codec`; this module turns decoded bodies into a typed `GenerationRequest`, builds the replies, and
packs/unpacks OpenPI frames. Formats: ``/work/shared/docs/wire-protocols.md`` and ``docs/architecture.md`` ("Wire").
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dreamzero.errors import InvalidObservation, InvalidRequest
from dreamzero.types import ModelBatch, SessionReport
from serve_graph import codec

GENERATIONS_PATH = "/v1/actions/generations"
METADATA_PATH = "/v1/actions/metadata"
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"
OPENPI_WS_PATH = "/v1/realtime/robot/openpi"

FORMS = ("normalised", "raw")
RESPONSE_FORMATS = ("envelope", "raw")
OUTPUT_FORMATS = ("numpy", "list")

#: observation keys of the normalised form (RLinf's DreamZero adapter); the first three decide the form
NORMALISED_KEYS = ("images", "state", "state_mask")
NORMALISED_OPTIONAL_KEYS = ("embodiment_id", "has_lapa_action", "is_cotrain_instance")
#: frames per row of a normalised `images` tensor: 1 (single frame) or a 4-frame stack
NORMALISED_FRAME_COUNTS = (1, 4)
DEFAULT_MAX_STATE_DIM = 64
MAX_SESSION_ID_LEN = 256
MAX_SEED = 2**63 - 1

_FORM_ALIASES = {"normalised": "normalised", "normalized": "normalised", "raw": "raw"}
_OBS = "input.observation"


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

    @property
    def batch_size(self) -> int:
        return len(self.session_ids)

    @property
    def route_key(self) -> str:
        """Pins every session of the request to one replica: explicit `routing_key`, else the first session id."""
        return self.routing_key or self.session_ids[0]

    def to_model_batch(self) -> ModelBatch:
        """The normalised form as a `ModelBatch` (prompts are used as sent: RLinf formats them itself)."""
        if self.form != "normalised":
            raise InvalidRequest("only a normalised-form request maps directly onto a ModelBatch; run preprocess")
        emb = self.observation.get("embodiment_id")
        return ModelBatch(
            images=self.observation["images"],
            state=self.observation["state"],
            state_mask=self.observation["state_mask"],
            prompts=list(self.prompts),
            session_ids=list(self.session_ids),
            negative_prompts=self.negative_prompts,
            reset_mask=list(self.reset_mask),
            expected_steps=self.expected_steps,
            expected_incarnations=self.expected_incarnations,
            seeds=self.seeds,
            embodiment_id=None if emb is None else [int(x) for x in emb],
        )


# 2. Parsing helpers (every error names its field) -----------------------------------------------------------------


def _type_name(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"array {v.dtype} {list(v.shape)}"
    return type(v).__name__


def _mapping(v: Any, name: str, required: bool = True) -> dict:
    if v is None and not required:
        return {}
    if not isinstance(v, Mapping):
        raise InvalidRequest(f"'{name}' must be an object, got {_type_name(v)}")
    return dict(v)


def _as_list(v: Any, name: str) -> list:
    if isinstance(v, np.ndarray):
        if v.ndim != 1:
            raise InvalidObservation(f"'{name}' must be a list, got {_type_name(v)}", field=name)
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return list(v)
    raise InvalidObservation(f"'{name}' must be a list, got {_type_name(v)}", field=name)


def _per_row(v: Any, name: str, b: int, scalar_types: tuple[type, ...]) -> list:
    """A per-row list of length B; a single scalar of `scalar_types` is broadcast to every row."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, scalar_types):
        return [v] * b
    items = _as_list(v, name)
    if len(items) != b:
        raise InvalidObservation(
            f"'{name}' has {len(items)} entries but the request has {b} sessions (one per row expected)", field=name
        )
    return items


def _strings(v: Any, name: str, b: int, allow_empty: bool = True) -> list[str]:
    items = _per_row(v, name, b, (str,))
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise InvalidObservation(f"'{name}[{i}]' must be a string, got {_type_name(s)}", field=name)
        if not allow_empty and not s:
            raise InvalidObservation(f"'{name}[{i}]' must not be empty", field=name)
    return items


def _bools(v: Any, name: str, b: int) -> list[bool]:
    items = _per_row(v, name, b, (bool,))
    out = []
    for i, x in enumerate(items):
        if isinstance(x, bool):
            out.append(x)
        elif isinstance(x, int) and x in (0, 1):  # msgpack/JSON clients that send 0/1
            out.append(bool(x))
        else:
            raise InvalidObservation(f"'{name}[{i}]' must be true or false, got {x!r}", field=name)
    return out


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(v, np.integer):
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidObservation(f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}", field=name)
    return v


def _choice(v: Any, name: str, allowed: Sequence[str], aliases: Mapping[str, str] | None = None) -> str:
    if isinstance(v, str):
        v2 = (aliases or {}).get(v.lower(), v)
        if v2 in allowed:
            return v2
    raise InvalidObservation(f"'{name}' must be one of {list(allowed)}, got {v!r}", field=name)


def _session_ids(v: Any) -> list[str]:
    name = "parameters.session_ids"
    if v is None:
        raise InvalidObservation(f"'{name}' is required: one unique, non-empty string per row", field=name)
    if isinstance(v, str):
        v = [v]
    items = _as_list(v, name)
    if not items:
        raise InvalidObservation(f"'{name}' must hold at least one session id", field=name)
    seen: set[str] = set()
    for i, s in enumerate(items):
        if not isinstance(s, str) or not s:
            raise InvalidObservation(f"'{name}[{i}]' must be a non-empty string, got {s!r}", field=name)
        if len(s) > MAX_SESSION_ID_LEN:
            raise InvalidObservation(f"'{name}[{i}]' is longer than {MAX_SESSION_ID_LEN} characters", field=name)
        if s in seen:
            raise InvalidObservation(f"'{name}' holds {s!r} twice; session ids must be unique", field=name)
        seen.add(s)
    return items


def _array(v: Any, name: str) -> np.ndarray:
    """A decoded observation leaf as an array: msgpack arrays pass through, JSON nested lists are converted."""
    if isinstance(v, np.ndarray):
        return v
    if isinstance(v, (np.generic, bool, int, float)):
        return np.asarray(v)
    if isinstance(v, (list, tuple)):
        try:
            arr = np.asarray(v)
        except (ValueError, TypeError):
            raise InvalidObservation(
                f"'{name}' is a ragged nested list; every row must have the same shape", field=name
            ) from None
        if arr.dtype.kind not in codec.ALLOWED_DTYPE_KINDS:
            raise InvalidObservation(
                f"'{name}' must be a rectangular list of numbers, booleans or strings, got dtype {arr.dtype}",
                field=name,
            )
        return arr
    raise InvalidObservation(f"'{name}' must be an array or a nested list, got {_type_name(v)}", field=name)


def _flatten(obs: Mapping, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """Nested observation objects become dotted keys: {"state": {"joint_position": x}} -> "state.joint_position"."""
    if depth > 4:
        raise InvalidObservation(f"'{_OBS}.{prefix}' is nested too deeply", field=f"{_OBS}.{prefix}")
    out: dict[str, Any] = {}
    for k, v in obs.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(_flatten(v, key, depth + 1))
        else:
            if key in out:
                raise InvalidObservation(f"'{_OBS}.{key}' is given twice", field=f"{_OBS}.{key}")
            out[key] = v
    return out


def infer_form(observation: Mapping) -> str:
    """``"normalised"`` when the observation carries `images`, `state` or `state_mask`, else ``"raw"``."""
    return "normalised" if any(k in observation for k in NORMALISED_KEYS) else "raw"


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
        f = f"{_OBS}.{extra[0]}"
        raise InvalidObservation(
            f"'{f}' is not a key of the normalised form (allowed: {list(allowed)}); raw embodiment keys cannot be "
            "mixed with images/state/state_mask",
            field=f,
        )
    for k in NORMALISED_KEYS:
        if k not in observation:
            raise InvalidObservation(f"'{_OBS}.{k}' is required in the normalised form", field=f"{_OBS}.{k}")
    out: dict[str, np.ndarray] = {}

    # images: uint8 [B, T, H, W, 3]
    name = f"{_OBS}.images"
    img = _array(observation["images"], name)
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
        name = f"{_OBS}.{key}"
        arr = _array(observation[key], name)
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
        name = f"{_OBS}.{key}"
        arr = _array(observation[key], name)
        if arr.ndim == 0:
            arr = np.full((b,), arr.item())
        if arr.shape != (b,) or arr.dtype.kind not in kinds:
            raise InvalidObservation(
                f"'{name}' must be {np.dtype(dtype).name} [B={b}], got {_type_name(arr)}", field=name
            )
        out[key] = arr.astype(dtype, copy=False)
    return out


def validate_raw(observation: Mapping, b: int) -> dict[str, np.ndarray]:
    """Structure only (the embodiment checks keys, shapes and dtypes): arrays with a leading batch dim of B."""
    if not observation:
        raise InvalidObservation(f"'{_OBS}' is empty; send the embodiment's observation keys", field=_OBS)
    out = {}
    for key, v in observation.items():
        name = f"{_OBS}.{key}"
        if not key:
            raise InvalidObservation(f"'{_OBS}' holds an empty key", field=_OBS)
        arr = _array(v, name)
        if arr.ndim == 0 or arr.shape[0] != b:
            raise InvalidObservation(
                f"'{name}' must have a leading batch dimension of {b} (one row per session), got shape "
                f"{list(arr.shape)}",
                field=name,
            )
        out[key] = arr
    return out


# 4. The request parser -------------------------------------------------------------------------------------------


def parse_generation_request(
    body: Any, flavour: str = codec.OPENPI, max_batch: int | None = None, max_state_dim: int = DEFAULT_MAX_STATE_DIM
) -> GenerationRequest:
    """Validate a decoded `POST /v1/actions/generations` body (see wire-protocols.md section 1)."""
    body = _mapping(body, "<body>")
    inp = _mapping(body.get("input"), "input")
    params = _mapping(body.get("parameters"), "parameters", required=False)
    runtime = _mapping(body.get("runtime"), "runtime", required=False)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidObservation(f"'model' must be a string, got {_type_name(model)}", field="model")

    # sessions define B; every per-row field must agree with it
    session_ids = _session_ids(params.get("session_ids"))
    b = len(session_ids)
    if max_batch is not None and b > max_batch:
        raise InvalidObservation(
            f"'parameters.session_ids' holds {b} sessions; this server accepts at most {max_batch} per request",
            field="parameters.session_ids",
        )
    if "prompt" not in inp:
        raise InvalidObservation("'input.prompt' is required: one instruction per row", field="input.prompt")
    prompts = _strings(inp["prompt"], "input.prompt", b)

    obs_raw = inp.get("observation")
    if not isinstance(obs_raw, Mapping):
        raise InvalidObservation(f"'{_OBS}' must be an object, got {_type_name(obs_raw)}", field=_OBS)
    obs = _flatten(obs_raw)
    form = _choice(inp["form"], "input.form", FORMS, _FORM_ALIASES) if inp.get("form") is not None else infer_form(obs)
    observation = validate_normalised(obs, b, max_state_dim) if form == "normalised" else validate_raw(obs, b)

    reset_mask = (
        _bools(params["reset_mask"], "parameters.reset_mask", b)
        if params.get("reset_mask") is not None
        else [False] * b
    )
    negative = params.get("negative_prompts")
    negative_prompts = None if negative is None else _strings(negative, "parameters.negative_prompts", b)
    seeds = None
    if params.get("seed") is not None:
        seed = params["seed"]
        if isinstance(seed, (list, tuple, np.ndarray)):
            seeds = [
                _int(s, f"parameters.seed[{i}]", 0, MAX_SEED)
                for i, s in enumerate(_per_row(seed, "parameters.seed", b, ()))
            ]
        else:
            seeds = [_int(seed, "parameters.seed", 0, MAX_SEED)] * b
    expected_steps = None
    if params.get("expected_steps") is not None:
        raw_steps = _per_row(params["expected_steps"], "parameters.expected_steps", b, (int,))
        expected_steps = [
            None if s is None else _int(s, f"parameters.expected_steps[{i}]", 0, 2**62) for i, s in enumerate(raw_steps)
        ]
    expected_incarnations = None
    if params.get("expected_incarnations") is not None:
        raw_inc = _per_row(params["expected_incarnations"], "parameters.expected_incarnations", b, (str,))
        for i, inc in enumerate(raw_inc):
            if inc is not None and (not isinstance(inc, str) or not 0 < len(inc) <= 64):
                raise InvalidObservation(
                    f"'parameters.expected_incarnations[{i}]' must be null or the 'incarnation' string of the last "
                    f"reply for that session, got {inc!r}",
                    field=f"parameters.expected_incarnations[{i}]",
                )
        expected_incarnations = list(raw_inc)
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
        response_format=_choice(
            runtime.get("response_format", "envelope"), "runtime.response_format", RESPONSE_FORMATS
        ),
        output_format=_choice(runtime.get("output_format", "numpy"), "runtime.output_format", OUTPUT_FORMATS),
        model=model,
        flavour=flavour,
    )


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
) -> dict:
    """The client side of `parse_generation_request` (what `clients.http_client` sends)."""
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
    return {
        "model": model,
        "input": inp,
        "parameters": params,
        "runtime": {"response_format": response_format, "output_format": output_format},
    }


# 5. Responses ----------------------------------------------------------------------------------------------------


def _session_dicts(sessions: Sequence[SessionReport | Mapping]) -> list[dict]:
    return [s.to_dict() if isinstance(s, SessionReport) else dict(s) for s in sessions]


def build_response(
    request: GenerationRequest,
    actions: np.ndarray,
    sessions: Sequence[SessionReport | Mapping],
    timings_ms: Mapping[str, float] | None = None,
    usage: Mapping[str, Any] | None = None,
) -> dict:
    """The reply for `request` in its `response_format` (sglang envelope or raw)."""
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
        return {"request_id": _new_id(), "actions": values, "parameters": params, **extras}
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
            }
        ],
        "usage": dict(usage) if usage is not None else {"batch_size": b, "action_horizon": h, "action_dim": d},
        **extras,
    }


def _new_id() -> str:
    return f"act_{uuid.uuid4().hex}"


@dataclass
class ActionsReply:
    """A decoded actions reply as a client sees it."""

    actions: np.ndarray  # float32 [B, H, D]
    sessions: list[dict]
    timings: dict[str, float]
    form: str | None


def parse_actions_response(resp: Any) -> ActionsReply:
    """Read actions out of an envelope (`data[0].action.values`) or a raw reply (`actions`).

    Raises `InvalidRequest` (the reply does not follow the protocol) naming the missing path.
    """
    if not isinstance(resp, Mapping):
        raise InvalidRequest(f"reply must be an object, got {_type_name(resp)}")
    if "data" in resp:
        try:
            action = resp["data"][0]["action"]
            values = action["values"]
        except (KeyError, IndexError, TypeError):
            raise InvalidRequest("envelope reply has no 'data[0].action.values'") from None
        shape = action.get("shape")
    elif "actions" in resp:
        values, shape = resp["actions"], None
    else:
        raise InvalidRequest(f"reply has neither 'data' nor 'actions' (keys: {sorted(resp)[:10]})")
    try:
        actions = np.asarray(values, dtype=np.float32)
        if shape is not None:
            actions = actions.reshape([int(s) for s in shape])
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"reply actions cannot be read as a float32 array of shape {shape}: {e}") from None
    sessions = resp.get("sessions") or []
    return ActionsReply(actions, [dict(s) for s in sessions], dict(resp.get("timings") or {}), resp.get("form"))


def error_body(code: str, message: str, field: str | None = None) -> dict:
    """HTTP error reply body: structured `error` plus FastAPI/sglang-style `detail` (see serve_graph.errors_http)."""
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


# 6. OpenPI WebSocket frames --------------------------------------------------------------------------------------

#: control keys of an OpenPI request; everything else is observation
OPENPI_CONTROL_KEYS = ("endpoint", "session_id", "prompt", "seed", "response_format")
OPENPI_ENDPOINTS = ("infer", "reset")
OPENPI_DEFAULT_SESSION = "default"
OPENPI_RESET_REPLY = {"status": "reset successful"}
#: OpenPI DROID observation keys -> the DROID embodiment's raw keys
OPENPI_DROID_KEY_MAP = {
    "observation/exterior_image_0_left": "video.exterior_image_1_left",
    "observation/exterior_image_1_left": "video.exterior_image_2_left",
    "observation/wrist_image_left": "video.wrist_image_left",
    "observation/joint_position": "state.joint_position",
    "observation/gripper_position": "state.gripper_position",
}
_TEXT_KEY = re.compile(r"^[\w./:-]{1,128}$")


def pack_frame(obj: Any, flavour: str = codec.OPENPI) -> bytes:
    """A binary OpenPI frame (msgpack with openpi array markers unless the peer used msgpack-numpy)."""
    return codec.encode_msgpack(obj, flavour)


def unpack_frame(data: bytes | str, max_bytes: int | None = None) -> tuple[Any, str]:
    """Decode a binary frame; a text frame is an `InvalidRequest` (the protocol is binary msgpack)."""
    if isinstance(data, str):
        raise InvalidRequest("text frames are not part of the protocol; send binary msgpack frames")
    codec.check_size(data, max_bytes)
    return codec.decode_msgpack(data)


def handshake_config(
    image_resolution: tuple[int, int] = (180, 320),
    n_external_cameras: int = 2,
    needs_wrist_camera: bool = True,
    needs_stereo_camera: bool = False,
    needs_session_id: bool = True,
    action_space: str = "joint_position",
    action_horizon: int | None = None,
    action_dim: int | None = None,
    **extra: Any,
) -> dict:
    """The policy server config sent as the first frame of every connection (DROID defaults)."""
    cfg: dict[str, Any] = {
        "image_resolution": [int(image_resolution[0]), int(image_resolution[1])],
        "n_external_cameras": int(n_external_cameras),
        "needs_wrist_camera": bool(needs_wrist_camera),
        "needs_stereo_camera": bool(needs_stereo_camera),
        "needs_session_id": bool(needs_session_id),
        "action_space": action_space,
    }
    if action_horizon is not None:
        cfg["action_horizon"] = int(action_horizon)
    if action_dim is not None:
        cfg["action_dim"] = int(action_dim)
    cfg.update(extra)
    return cfg


@dataclass
class OpenPIRequest:
    endpoint: str  # "infer" | "reset"
    session_id: str
    prompt: str | None
    seed: int | None
    observation: dict[str, np.ndarray]  # every non-control key, as sent (e.g. "observation/joint_position")
    reply_as_dict: bool  # {"actions": ...} (openpi clients) vs the bare array (DreamZero's own client)
    flavour: str = codec.OPENPI


def parse_openpi_request(msg: Any, flavour: str = codec.OPENPI) -> OpenPIRequest:
    """Validate a decoded OpenPI message. A missing `endpoint` means infer.

    Reply shape: explicit ``response_format: "dict" | "array"``; else DreamZero's own client (which sends
    `endpoint`) gets the bare array and openpi's `WebsocketClientPolicy` (which does not) gets a dict.
    """
    if not isinstance(msg, Mapping):
        raise InvalidRequest(f"an OpenPI message must be a msgpack map, got {_type_name(msg)}")
    endpoint = _choice(msg.get("endpoint", "infer"), "endpoint", OPENPI_ENDPOINTS)
    session_id = msg.get("session_id", OPENPI_DEFAULT_SESSION)
    if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID_LEN:
        raise InvalidObservation(f"'session_id' must be a non-empty string, got {session_id!r}", field="session_id")
    prompt = msg.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidObservation(f"'prompt' must be a string, got {_type_name(prompt)}", field="prompt")
    seed = None if msg.get("seed") is None else _int(msg["seed"], "seed", 0, MAX_SEED)
    if "response_format" in msg:
        reply_as_dict = _choice(msg["response_format"], "response_format", ("dict", "array")) == "dict"
    else:
        reply_as_dict = "endpoint" not in msg
    observation = {}
    for k, v in msg.items():
        if k in OPENPI_CONTROL_KEYS:
            continue
        if not _TEXT_KEY.match(k):
            raise InvalidObservation(f"observation key {k[:64]!r} is not a valid key", field=k[:64])
        observation[k] = _array(v, k)
    if endpoint == "infer" and prompt is None:
        raise InvalidObservation("'prompt' is required for infer", field="prompt")
    return OpenPIRequest(endpoint, session_id, prompt, seed, observation, reply_as_dict, flavour)


def infer_reply(actions: np.ndarray, as_dict: bool, extra: Mapping[str, Any] | None = None) -> Any:
    """The infer reply: the bare float32 array, or ``{"actions": array, **extra}``."""
    actions = np.ascontiguousarray(actions, dtype=np.float32)
    return {"actions": actions, **(extra or {})} if as_dict else actions


def error_frame(message: str, code: str | None = None, field: str | None = None) -> dict:
    """``{"type": "error", "message": ...}`` (vllm-omni style); the server keeps the socket open after it."""
    frame: dict[str, Any] = {"type": "error", "message": message}
    if code is not None:
        frame["code"] = code
    if field is not None:
        frame["field"] = field
    return frame


def is_error_frame(obj: Any) -> bool:
    return isinstance(obj, Mapping) and obj.get("type") == "error"
