"""The ZeroMQ door's decoder: RLDX-1 / Isaac-GR00T requests -> `RldxRequest`, a `get_action` -> `ActionRequest` (raw
observation keys with B rows, its `RowOptions`), and `get_action`'s reply. Server-side only; the message codec
(`pack`, `unpack`, the tagged ndarrays and `ModalityConfig`) lives in `dreamzero_client.wire.rldx`, which the
client uses too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deployments.requests import fields as f
from deployments.requests.rows import RowOptions
from dreamzero.errors import InvalidObservation, InvalidRequest

ENDPOINTS = ("ping", "kill", "get_action", "reset", "get_modality_config")
#: what `ping` answers (RLDX's own reply)
PING_REPLY = {"status": "ok", "message": "Server is running"}
#: keys a language instruction may arrive under, besides the advertised one (GR00T sim wrappers use `task`)
LANGUAGE_PREFIXES = ("annotation.", "language.")
LANGUAGE_ALIASES = ("task", "language", "prompt")


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
class ActionRequest:
    """A decoded `get_action`: raw observation keys with B rows and its rows (under the client's own session ids)."""

    observation: dict[str, np.ndarray]
    rows: RowOptions
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
    return ActionRequest(out, parse_options(opts, prompts), key)


def parse_options(opts: Mapping, prompts: list[str]) -> RowOptions:
    """`get_action`'s `options` for B rows (RLDX-1 names: `session_ids`, `reset_memory`, plus the shared options)."""
    b = len(prompts)
    ids = opts.get("session_ids")
    session_ids = [f"default_{i}" for i in range(b)] if ids is None else f.session_ids_field(ids)
    if len(session_ids) != b:
        raise InvalidObservation(
            f"'options.session_ids' has {len(session_ids)} ids for {b} observation rows", field="options.session_ids"
        )
    reset = opts.get("reset_memory")
    reset_mask = None if reset is None else f.bools(reset, "options.reset_memory", b)
    return RowOptions.read(prompts, session_ids, reset_mask, opts, "options.")


def parse_reset(data: Mapping) -> list[str] | None:
    """`reset {options}` -> the session ids to clear, or None for all of the caller's sessions."""
    opts = f.mapping(data.get("options"), "options", required=False)
    ids = opts.get("session_ids")
    return None if ids is None else f.session_ids_field(ids)


def action_reply(actions: dict[str, np.ndarray], info: dict) -> list:
    """`get_action`'s reply: [action, info] (RLDX clients turn the list into a tuple)."""
    return [{k: np.ascontiguousarray(v, dtype=np.float32) for k, v in actions.items()}, info]
