"""The RLDX-1 / Isaac-GR00T ZeroMQ message codec, shared by the ZMQ front door and `dreamzero_client.zmq_client`
(the server's request parsers: `deployments.requests.rldx`).

One ZMQ frame = one msgpack blob. Two values travel as tagged maps:

- an ndarray as ``{"__ndarray_class__": True, "as_npy": <np.save bytes>}`` (read back with pickling refused),
- a modality description as ``{"__ModalityConfig_class__": True, "as_json": {delta_indices, modality_keys, ...}}``.

A request is ``{"endpoint": str, "data": {...}, "api_token": str}``; a missing endpoint means ``get_action``. Replies
are the endpoint's value, or ``{"error": str}`` for any failure (RLDX clients turn that into a RuntimeError).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import numpy as np

from dreamzero_client.errors import InvalidRequest

NDARRAY_TAG, MODALITY_TAG = "__ndarray_class__", "__ModalityConfig_class__"


@dataclass
class ModalityConfig:
    """Which keys of a modality a policy reads, at which time offsets (RLDX-1's `ModalityConfig` fields)."""

    delta_indices: list[int]
    modality_keys: list[str]
    sin_cos_embedding_keys: list[str] | None = None
    mean_std_embedding_keys: list[str] | None = None
    action_configs: list[dict] | None = None


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
