"""Field readers for decoded request bodies: each checks one value and raises an error that names the field. The
server's (every door's decoder reads with them); the robot's client package only writes bodies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dreamzero_client.errors import InvalidObservation, InvalidRequest
from dreamzero_client.wire import codec

MAX_SESSION_ID_LEN = 256
MAX_SEED = 2**63 - 1
OBSERVATION = "input.observation"


def type_name(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"array {v.dtype} {list(v.shape)}"
    return type(v).__name__


def mapping(v: Any, name: str, required: bool = True) -> dict:
    if v is None and not required:
        return {}
    if not isinstance(v, Mapping):
        raise InvalidRequest(f"'{name}' must be an object, got {type_name(v)}")
    return dict(v)


def as_list(v: Any, name: str) -> list:
    if isinstance(v, np.ndarray):
        if v.ndim != 1:
            raise InvalidObservation(f"'{name}' must be a list, got {type_name(v)}", field=name)
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return list(v)
    raise InvalidObservation(f"'{name}' must be a list, got {type_name(v)}", field=name)


def per_row(v: Any, name: str, b: int, scalar_types: tuple[type, ...]) -> list:
    """A per-row list of length B; a single scalar of `scalar_types` is broadcast to every row."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, scalar_types):
        return [v] * b
    items = as_list(v, name)
    if len(items) != b:
        raise InvalidObservation(
            f"'{name}' has {len(items)} entries but the request has {b} sessions (one per row expected)", field=name
        )
    return items


def strings(v: Any, name: str, b: int, allow_empty: bool = True) -> list[str]:
    items = per_row(v, name, b, (str,))
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise InvalidObservation(f"'{name}[{i}]' must be a string, got {type_name(s)}", field=name)
        if not allow_empty and not s:
            raise InvalidObservation(f"'{name}[{i}]' must not be empty", field=name)
    return items


def bools(v: Any, name: str, b: int) -> list[bool]:
    items = per_row(v, name, b, (bool,))
    out = []
    for i, x in enumerate(items):
        if isinstance(x, bool):
            out.append(x)
        elif isinstance(x, int) and x in (0, 1):  # msgpack/JSON clients that send 0/1
            out.append(bool(x))
        else:
            raise InvalidObservation(f"'{name}[{i}]' must be true or false, got {x!r}", field=name)
    return out


def flag(v: Any, name: str) -> bool:
    """One true/false option (0/1 accepted, as `bools`)."""
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise InvalidObservation(f"'{name}' must be true or false, got {type_name(v)} {str(v)[:32]}", field=name)


def int_in(v: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(v, np.integer):
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidObservation(f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}", field=name)
    return v


def choice(v: Any, name: str, allowed: Sequence[str], aliases: Mapping[str, str] | None = None) -> str:
    if isinstance(v, str):
        v2 = (aliases or {}).get(v.lower(), v)
        if v2 in allowed:
            return v2
    raise InvalidObservation(f"'{name}' must be one of {list(allowed)}, got {v!r}", field=name)


def session_ids_field(v: Any) -> list[str]:
    name = "parameters.session_ids"
    if v is None:
        raise InvalidObservation(f"'{name}' is required: one unique, non-empty string per row", field=name)
    if isinstance(v, str):
        v = [v]
    items = as_list(v, name)
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


def array(v: Any, name: str) -> np.ndarray:
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
    raise InvalidObservation(f"'{name}' must be an array or a nested list, got {type_name(v)}", field=name)


def flatten(obs: Mapping, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """Nested observation objects become dotted keys: {"state": {"joint_position": x}} -> "state.joint_position"."""
    if depth > 4:
        raise InvalidObservation(f"'{OBSERVATION}.{prefix}' is nested too deeply", field=f"{OBSERVATION}.{prefix}")
    out: dict[str, Any] = {}
    for k, v in obs.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key, depth + 1))
        else:
            if key in out:
                raise InvalidObservation(f"'{OBSERVATION}.{key}' is given twice", field=f"{OBSERVATION}.{key}")
            out[key] = v
    return out
