"""The RLDX-1 / Isaac-GR00T ZeroMQ message codec, shared by the ZMQ front door and `dreamzero_client.zmq_client`.

One ZMQ frame = one msgpack blob. Two values travel as tagged maps:

- an ndarray as ``{"__ndarray_class__": True, "as_npy": <np.save bytes>}`` (read back with pickling refused),
- a modality description as ``{"__ModalityConfig_class__": True, "as_json": {delta_indices, modality_keys, ...}}``.

A request is ``{"endpoint": str, "data": {...}, "api_token": str}``; a missing endpoint means ``get_action``. Replies
are the endpoint's value, or ``{"error": str}`` for any failure (RLDX clients turn that into a RuntimeError).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import numpy as np

from dreamzero_client.errors import InvalidObservation, InvalidRequest
from dreamzero_client.wire import fields as f
from dreamzero_client.wire.generations import action_prefixes, rtc_counts

NDARRAY_TAG, MODALITY_TAG = "__ndarray_class__", "__ModalityConfig_class__"
ENDPOINTS = ("ping", "kill", "get_action", "reset", "get_modality_config")
#: what `ping` answers (RLDX's own reply)
PING_REPLY = {"status": "ok", "message": "Server is running"}
#: keys a language instruction may arrive under, besides the advertised one (GR00T sim wrappers use `task`)
LANGUAGE_PREFIXES = ("annotation.", "language.")
LANGUAGE_ALIASES = ("task", "language", "prompt")


@dataclass
class ModalityConfig:
    """Which keys of a modality a policy reads, at which time offsets (RLDX-1's `ModalityConfig` fields)."""

    delta_indices: list[int]
    modality_keys: list[str]
    sin_cos_embedding_keys: list[str] | None = None
    mean_std_embedding_keys: list[str] | None = None
    action_configs: list[dict] | None = None


# 1. Codec -----------------------------------------------------------------------------------------------------------


def _encode_custom(obj: Any) -> Any:
    if isinstance(obj, ModalityConfig):
        return {MODALITY_TAG: True, "as_json": asdict(obj)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise InvalidRequest(f"cannot send an object array (dtype {obj.dtype}); send numbers, bools or strings")
        buf = io.BytesIO()
        np.save(buf, obj, allow_pickle=False)
        return {NDARRAY_TAG: True, "as_npy": buf.getvalue()}
    raise TypeError(f"cannot encode {type(obj).__name__} for the RLDX wire")


def _decode_custom(obj: dict) -> Any:
    if obj.get(NDARRAY_TAG) is True:
        raw = obj.get("as_npy")
        if not isinstance(raw, bytes):
            raise InvalidRequest("a tagged ndarray needs 'as_npy' bytes (np.save output)")
        try:
            return np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as exc:  # noqa: BLE001 - bad bytes (or a pickled array) are the sender's error
            raise InvalidRequest(f"'as_npy' is not a readable .npy array without pickles: {exc}") from None
    if obj.get(MODALITY_TAG) is True:
        body = obj.get("as_json")
        if not isinstance(body, Mapping):
            raise InvalidRequest("a tagged ModalityConfig needs an 'as_json' map")
        try:
            return ModalityConfig(**body)
        except TypeError as exc:
            raise InvalidRequest(f"'as_json' is not a ModalityConfig: {exc}") from None
    return obj


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_encode_custom, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """msgpack -> Python with tagged ndarrays / ModalityConfigs restored; InvalidRequest for anything unreadable."""
    try:
        return msgpack.unpackb(data, object_hook=_decode_custom, raw=False, strict_map_key=False)
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - garbage bytes from the network
        raise InvalidRequest(f"the message is not a msgpack RLDX request ({type(exc).__name__})") from None


def error_reply(message: str) -> dict:
    return {"error": message}


# 2. Requests --------------------------------------------------------------------------------------------------------


@dataclass
class RldxRequest:
    endpoint: str
    data: dict
    api_token: str | None


def parse_request(message: Any) -> RldxRequest:
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"a request is a map {{endpoint, data, api_token}}, got {f.type_name(message)}")
    endpoint = message.get("endpoint", "get_action")
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"Unknown endpoint: {endpoint!r}; known: {list(ENDPOINTS)}")
    data = message.get("data")
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise InvalidObservation(f"'data' must be a map, got {f.type_name(data)}", field="data")
    token = message.get("api_token")
    if token is not None and not isinstance(token, str):
        raise InvalidRequest("'api_token' must be a string")
    return RldxRequest(endpoint, dict(data), token)


@dataclass
class ActionOptions:
    """`get_action` options, per row of B (RLDX-1 names, plus our continuity fields)."""

    session_ids: list[str]
    reset_mask: list[bool]
    rtc_prefix_len: list[int | None] | None = None
    rtc_exec_horizon: list[int | None] | None = None
    action_prefix: list[np.ndarray | None] | None = None
    expected_steps: list[int | None] | None = None
    expected_incarnations: list[str | None] | None = None
    seeds: list[int] | None = None
    return_video: bool = False  # info["video"]: uint8 [B, T, H, W, 3] predicted frames


@dataclass
class ActionRequest:
    """A decoded `get_action`: raw observation keys with B rows, B instructions, the options."""

    observation: dict[str, np.ndarray]
    prompts: list[str]
    options: ActionOptions
    language_key: str | None = None
    extra: dict = field(default_factory=dict)


def _language(obs: Mapping, b: int, preferred: str | None) -> tuple[str | None, list[str]]:
    names = [k for k in obs if k == preferred or k in LANGUAGE_ALIASES or k.startswith(LANGUAGE_PREFIXES)]
    if not names:
        return None, [""] * b
    key = preferred if preferred in names else names[0]
    return key, f.strings(obs[key], f"observation.{key}", b)


def parse_get_action(data: Mapping, language_key: str | None = None, max_batch: int | None = None) -> ActionRequest:
    """`{observation, options}` -> ActionRequest. `video.*` (B,T,H,W,3) pass as they are; `state.*` (B,T,D) keep
    their last step (the model reads the current state only); the language key gives B instructions."""
    obs = f.mapping(data.get("observation"), "observation")
    opts = f.mapping(data.get("options"), "options", required=False)
    states = [k for k in obs if k.startswith("state.")]
    if not states:
        raise InvalidObservation("'observation' has no 'state.<key>' array (B, T, D)", field="observation")
    first = f.array(obs[states[0]], f"observation.{states[0]}")
    if first.ndim not in (2, 3):
        raise InvalidObservation(
            f"'observation.{states[0]}' must be (B, T, D) or (B, D), got shape {list(first.shape)}",
            field=f"observation.{states[0]}",
        )
    b = int(first.shape[0])
    if b < 1 or (max_batch is not None and b > max_batch):
        raise InvalidObservation(
            f"'observation.{states[0]}' holds {b} rows; this server accepts 1 to {max_batch}",
            field=f"observation.{states[0]}",
        )
    key, prompts = _language(obs, b, language_key)
    out: dict[str, np.ndarray] = {}
    for name, value in obs.items():
        if name == key:
            continue
        arr = f.array(value, f"observation.{name}")
        if name.startswith("state."):
            if arr.ndim == 3:
                arr = arr[:, -1]
            if arr.ndim != 2 or arr.shape[0] != b:
                raise InvalidObservation(
                    f"'observation.{name}' must be (B={b}, T, D), got shape {list(np.shape(value))}",
                    field=f"observation.{name}",
                )
        elif name.startswith("video."):
            if arr.ndim != 5 or arr.shape[0] != b or arr.shape[-1] != 3:
                raise InvalidObservation(
                    f"'observation.{name}' must be uint8 (B={b}, T, H, W, 3), got shape {list(arr.shape)}",
                    field=f"observation.{name}",
                )
        else:
            continue  # other keys (e.g. a second language annotation) are not model inputs
        out[name] = arr
    return ActionRequest(out, prompts, parse_options(opts, b), key)


def parse_options(opts: Mapping, b: int) -> ActionOptions:
    ids = opts.get("session_ids")
    session_ids = [f"default_{i}" for i in range(b)] if ids is None else f.session_ids_field(ids)
    if len(session_ids) != b:
        raise InvalidObservation(
            f"'options.session_ids' has {len(session_ids)} ids for {b} observation rows", field="options.session_ids"
        )
    reset = opts.get("reset_memory")
    reset_mask = [False] * b if reset is None else f.bools(reset, "options.reset_memory", b)
    steps = opts.get("expected_steps")
    expected_steps = None
    if steps is not None:
        expected_steps = [
            None if s is None else f.int_in(s, f"options.expected_steps[{i}]", 0, 2**62)
            for i, s in enumerate(f.per_row(steps, "options.expected_steps", b, (int,)))
        ]
    incs = opts.get("expected_incarnations")
    expected_incarnations = None
    if incs is not None:
        expected_incarnations = f.per_row(incs, "options.expected_incarnations", b, (str,))
        for i, inc in enumerate(expected_incarnations):
            if inc is not None and (not isinstance(inc, str) or not 0 < len(inc) <= 64):
                raise InvalidObservation(
                    f"'options.expected_incarnations[{i}]' must be null or the 'incarnation' of the last reply",
                    field=f"options.expected_incarnations[{i}]",
                )
    seed = opts.get("seed")
    seeds = None
    if seed is not None:
        seeds = [f.int_in(s, "options.seed", 0, f.MAX_SEED) for s in f.per_row(seed, "options.seed", b, (int,))]
    return ActionOptions(
        session_ids=session_ids,
        reset_mask=reset_mask,
        rtc_prefix_len=rtc_counts(opts.get("rtc_prefix_len"), "options.rtc_prefix_len", b),
        rtc_exec_horizon=rtc_counts(opts.get("rtc_exec_horizon"), "options.rtc_exec_horizon", b),
        action_prefix=action_prefixes(opts.get("action_prefix"), "options.action_prefix", b),
        expected_steps=expected_steps,
        expected_incarnations=expected_incarnations,
        seeds=seeds,
        return_video=f.flag(opts.get("return_video", False), "options.return_video"),
    )


def parse_reset(data: Mapping) -> list[str] | None:
    """`reset {options}` -> the session ids to clear, or None for all of the caller's sessions."""
    opts = f.mapping(data.get("options"), "options", required=False)
    ids = opts.get("session_ids")
    return None if ids is None else f.session_ids_field(ids)


# 3. Replies ---------------------------------------------------------------------------------------------------------


def action_reply(actions: dict[str, np.ndarray], info: dict) -> list:
    """`get_action`'s reply: [action, info] (RLDX clients turn the list into a tuple)."""
    return [{k: np.ascontiguousarray(v, dtype=np.float32) for k, v in actions.items()}, info]
