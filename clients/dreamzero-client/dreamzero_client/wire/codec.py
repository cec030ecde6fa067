"""Body codec shared by the server and the clients: msgpack (two NumPy marker flavours) and JSON.

Flavours (what `decode_body` reports and `encode_body` answers in):
- ``"openpi"``: openpi / sglang marker ``{b"__ndarray__": True, b"data", b"dtype", b"shape"}`` and
  ``{b"__npgeneric__": True, b"data", b"dtype"}`` for NumPy scalars. The default for msgpack.
- ``"msgpack_numpy"``: msgpack-numpy's ``{b"nd": True, b"type", b"kind", b"shape", b"data"}`` (``nd: False`` = scalar).
- ``"json"``: arrays travel as nested lists; the request parser turns them into arrays where it expects arrays.

Markers are decoded here, never by msgpack-numpy (which unpickles object arrays): only bool, integer, float and
fixed-width string dtypes. Decoded arrays are read-only views of the body. Every decode stops at its `DecodeLimits`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import numpy as np

from dreamzero_client.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from dreamzero_client.wire.limits import DEFAULT_LIMITS, MAX_DEPTH, Budget, DecodeLimits, check_tree, prescan_json

OPENPI = "openpi"
MSGPACK_NUMPY = "msgpack_numpy"
JSON = "json"
FLAVOURS = (OPENPI, MSGPACK_NUMPY, JSON)

MSGPACK_CONTENT_TYPE = "application/msgpack"
JSON_CONTENT_TYPE = "application/json"

#: dtype kinds a client may send: bool, signed/unsigned int, float, bytes, unicode (never object/void/complex)
ALLOWED_DTYPE_KINDS = frozenset("biufSU")
MAX_NDIM = 32
MAX_DIM = 2**31 - 1
_MAX_DTYPE_STR = 16


def flavour_for_content_type(content_type: str | None) -> str:
    """``"openpi"`` (msgpack, flavour refined while decoding) or ``"json"`` (also for none, as curl and sglang)."""
    ct = (content_type or "").split(";", 1)[0].strip().lower()
    if "msgpack" in ct:
        return OPENPI
    if ct in ("", "application/json") or ct.endswith("+json"):
        return JSON
    raise UnsupportedMediaType(
        f"unsupported Content-Type {content_type!r}; send 'application/msgpack' (NumPy arrays as openpi "
        "'__ndarray__' or msgpack-numpy 'nd' markers) or 'application/json' (arrays as nested lists)"
    )


def content_type_for(flavour: str) -> str:
    """The reply Content-Type for a flavour."""
    return JSON_CONTENT_TYPE if flavour == JSON else MSGPACK_CONTENT_TYPE


def decode_body(
    body: bytes, content_type: str | None, max_bytes: int | None = None, limits: DecodeLimits | None = None
) -> tuple[Any, str]:
    """``(object, flavour)`` of a body decoded within `limits` (default `DEFAULT_LIMITS`). `max_bytes` (else
    `limits.max_bytes` when given) refuses a longer body before parsing; a client reading a reply passes neither."""
    size_limit = max_bytes if max_bytes is not None else (limits.max_bytes if limits is not None else None)
    check_size(body, size_limit)
    limits = limits or DEFAULT_LIMITS
    flavour = flavour_for_content_type(content_type)
    if flavour == JSON:
        return decode_json(body, limits), JSON
    return decode_msgpack(body, limits)


def check_size(body: bytes | str, max_bytes: int | None) -> None:
    if max_bytes is not None and len(body) > max_bytes:
        raise PayloadTooLarge(f"body is {len(body)} bytes; this server accepts at most {max_bytes} bytes per request")


def decode_json(body: bytes | str, limits: DecodeLimits | None = None) -> Any:
    if not body:
        raise InvalidRequest("empty request body; expected a JSON object")
    limits = limits or DEFAULT_LIMITS
    prescan_json(body, limits)
    try:
        obj = json.loads(body)
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not UTF-8 JSON: {e}") from None
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    except ValueError as e:  # e.g. an integer literal longer than Python converts (4300 digits)
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    check_tree(obj, limits)
    return obj


def decode_msgpack(body: bytes, limits: DecodeLimits | None = None) -> tuple[Any, str]:
    """``(object, flavour)``: msgpack unpacked within `limits`, markers made arrays; flavour: the first marker's."""
    if not body:
        raise InvalidRequest("empty request body; expected a msgpack map")
    limits = limits or DEFAULT_LIMITS
    budget = Budget(limits)
    n = limits.max_container_len
    try:
        # raw=False: str stays str, bin stays bytes; strict_map_key=False: marker keys arrive as bytes. The hooks
        # count each finished container, so a body of empty lists stops at max_objects.
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,
            ext_hook=_reject_ext,
            list_hook=budget.list_hook,
            object_pairs_hook=budget.pairs_hook,
            max_array_len=n,
            max_map_len=n,
        )
    except InvalidRequest:
        raise
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"msgpack body holds a string that is not UTF-8: {e}") from None
    except ValueError as e:
        if "exceeds max_" in str(e):  # the unpacker's own length limits
            message = f"request body holds a list or map longer than {n} items (decode limit max_container_len)"
            raise InvalidRequest(message) from None
        raise InvalidRequest(f"request body is not valid msgpack: {e}") from None
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as e:
        raise InvalidRequest(f"request body is not valid msgpack: {e}") from None
    seen: list[str] = []
    out = _restore(obj, "", seen, 0, limits.max_depth)
    return out, (seen[0] if seen else OPENPI)


def _reject_ext(code: int, data: bytes) -> Any:
    raise InvalidRequest(f"msgpack extension type {code} is not accepted; send arrays with NumPy markers")


def _key(k: Any, path: str) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, bytes):
        try:
            return k.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"map key at '{path or '<body>'}' is not UTF-8: {k[:32]!r}") from None
    raise InvalidRequest(f"map key at '{path or '<body>'}' must be a string, got {type(k).__name__} {k!r}")


def clip_repr(value: Any, keep: int = 120) -> str:
    """`repr(value)` cut to `keep` characters without building all of it (a declared shape may be huge)."""
    if isinstance(value, (list, tuple)) and len(value) > keep // 2:
        head = ", ".join(repr(v)[:16] for v in value[:8])
        return f"[{head}, ... ({len(value)} items)]"
    if isinstance(value, dict) and len(value) > keep // 2:
        return f"<a map of {len(value)} items>"
    text = repr(value) if not isinstance(value, (str, bytes)) or len(value) <= keep else repr(value[:keep])
    return text if len(text) <= keep else f"{text[:keep]}..."


def _short(path: str, keep: int = 120) -> str:
    """A path as an error message quotes it: deep paths are cut in the middle."""
    return path if len(path) <= keep else f"{path[: keep // 2]}...{path[-keep // 2 :]}"


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _restore(obj: Any, path: str, seen: list[str], depth: int, max_depth: int = MAX_DEPTH) -> Any:
    """Walk the unpacked tree: markers -> arrays, map keys -> str. `seen` collects marker flavours in order."""
    if depth > max_depth and isinstance(obj, (dict, list)):
        raise InvalidRequest(f"'{_short(path)}': nested more than {max_depth} levels deep (max_depth)")
    if isinstance(obj, dict):
        d = {_key(k, path): v for k, v in obj.items()}
        if "__ndarray__" in d:
            seen.append(OPENPI)
            return _openpi_array(d, path)
        if "__npgeneric__" in d:
            seen.append(OPENPI)
            return _openpi_scalar(d, path)
        if "nd" in d and "data" in d and ("type" in d or "kind" in d):
            seen.append(MSGPACK_NUMPY)
            return _msgpack_numpy(d, path)
        if "complex" in d and "data" in d and len(d) == 2:
            raise InvalidRequest(f"'{path or '<body>'}': complex numbers are not accepted")
        return {k: _restore(v, _join(path, k), seen, depth + 1, max_depth) for k, v in d.items()}
    if isinstance(obj, list):
        return [
            _restore(v, _join(path, i), seen, depth + 1, max_depth) if isinstance(v, (dict, list)) else v
            for i, v in enumerate(obj)
        ]
    return obj


def _dtype(spec: Any, path: str) -> np.dtype:
    where = path or "<body>"
    if isinstance(spec, bytes):
        spec = spec.decode("ascii", "replace")
    if not isinstance(spec, str) or not spec or len(spec) > _MAX_DTYPE_STR:
        raise InvalidRequest(f"'{where}': array dtype must be a short dtype string like '<f4', got {spec!r}")
    try:
        dt = np.dtype(spec)
    except (TypeError, ValueError, SyntaxError):
        raise InvalidRequest(f"'{where}': unknown array dtype {spec!r}") from None
    if dt.kind not in ALLOWED_DTYPE_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise InvalidRequest(
            f"'{where}': dtype {spec!r} is not accepted (object, void/structured, complex and datetime dtypes are "
            "refused); send bool, integer, float or fixed-width string arrays"
        )
    if dt.itemsize == 0:
        raise InvalidRequest(f"'{where}': dtype {spec!r} has no item size")
    return dt


def _shape(spec: Any, path: str) -> tuple[int, ...]:
    where = path or "<body>"
    if not isinstance(spec, (list, tuple)) or len(spec) > MAX_NDIM:
        raise InvalidRequest(
            f"'{where}': array shape must be a list of at most {MAX_NDIM} integers, got {clip_repr(spec)}"
        )
    for d in spec:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0 or d > MAX_DIM:
            raise InvalidRequest(f"'{where}': array shape {list(spec)} holds {d!r}; dims must be integers >= 0")
    return tuple(spec)


def _buffer_array(data: Any, dt: np.dtype, shape: tuple[int, ...], path: str) -> np.ndarray:
    where = path or "<body>"
    if not isinstance(data, bytes):
        raise InvalidRequest(f"'{where}': array data must be raw bytes, got {type(data).__name__}")
    expected = math.prod(shape) * dt.itemsize
    if len(data) != expected:
        raise InvalidRequest(
            f"'{where}': array data is {len(data)} bytes but shape {list(shape)} of dtype {dt.str} needs {expected}"
        )
    try:
        arr = np.frombuffer(data, dtype=dt).reshape(shape)  # read-only view of the body: no copy
    except ValueError:  # a zero-size shape whose other dims overflow NumPy's size limit
        raise InvalidRequest(f"'{where}': array shape {list(shape)} is larger than NumPy can address") from None
    if not dt.isnative and dt.byteorder != "|":
        arr = arr.astype(dt.newbyteorder("="))  # big-endian senders: convert once here so consumers see native data
        arr.flags.writeable = False
    return arr


def _openpi_array(d: dict, path: str) -> np.ndarray:
    missing = [k for k in ("data", "dtype", "shape") if k not in d]
    if missing or d["__ndarray__"] is not True:
        raise InvalidRequest(f"'{path or '<body>'}': malformed '__ndarray__' marker (missing {missing or 'True'})")
    return _buffer_array(d["data"], _dtype(d["dtype"], path), _shape(d["shape"], path), path)


def _openpi_scalar(d: dict, path: str) -> np.generic:
    where = path or "<body>"
    if "data" not in d or "dtype" not in d:
        raise InvalidRequest(f"'{where}': malformed '__npgeneric__' marker (needs 'data' and 'dtype')")
    dt = _dtype(d["dtype"], path)
    value = d["data"]
    if not isinstance(value, (bool, int, float, str, bytes)):
        raise InvalidRequest(f"'{where}': NumPy scalar data must be a number, got {type(value).__name__}")
    try:
        return dt.type(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidRequest(f"'{where}': NumPy scalar {value!r} does not fit dtype {dt.str}: {e}") from None


def _msgpack_numpy(d: dict, path: str) -> np.ndarray | np.generic:
    where = path or "<body>"
    kind = d.get("kind", b"")
    if kind not in (b"", ""):
        raise InvalidRequest(f"'{where}': msgpack-numpy kind {kind!r} is not accepted (object/void arrays refused)")
    dt = _dtype(d.get("type"), path)
    if d["nd"] is True:
        return _buffer_array(d["data"], dt, _shape(d.get("shape"), path), path)
    if d["nd"] is False:
        return _buffer_array(d["data"], dt, (1,), path)[0]
    raise InvalidRequest(f"'{where}': malformed msgpack-numpy marker ('nd' must be true or false)")


def encode_body(obj: Any, flavour: str = OPENPI) -> tuple[bytes, str]:
    """Encode a reply in the client's flavour; returns ``(bytes, content_type)``."""
    if flavour == JSON:
        return encode_json(obj), JSON_CONTENT_TYPE
    return encode_msgpack(obj, flavour), MSGPACK_CONTENT_TYPE


def encode_msgpack(obj: Any, flavour: str = OPENPI) -> bytes:
    if flavour not in (OPENPI, MSGPACK_NUMPY):
        raise ValueError(f"msgpack flavour must be {OPENPI!r} or {MSGPACK_NUMPY!r}, got {flavour!r}")
    default = _openpi_default if flavour == OPENPI else _msgpack_numpy_default
    return msgpack.packb(obj, default=default, use_bin_type=True)


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, default=_json_default, separators=(",", ":")).encode("utf-8")


def _check_encodable(arr: np.ndarray | np.generic) -> None:
    if arr.dtype.kind not in ALLOWED_DTYPE_KINDS or arr.dtype.fields is not None:
        raise TypeError(f"cannot encode arrays of dtype {arr.dtype} (only bool, int, float, string)")


def _openpi_default(obj: Any) -> Any:
    # Marker keys are bytes (bin) because openpi's unpacker looks them up as b"__ndarray__".
    if isinstance(obj, np.ndarray):
        _check_encodable(obj)
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        _check_encodable(obj)
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return _plain_default(obj)


def _msgpack_numpy_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        _check_encodable(obj)
        return {b"nd": True, b"type": obj.dtype.str, b"kind": b"", b"shape": list(obj.shape), b"data": obj.tobytes()}
    if isinstance(obj, np.generic):
        _check_encodable(obj)
        return {b"nd": False, b"type": obj.dtype.str, b"data": obj.tobytes()}
    return _plain_default(obj)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist() if isinstance(obj, np.ndarray) else obj.item()
    return _plain_default(obj)


def _plain_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    if hasattr(obj, "to_dict"):  # e.g. dreamzero.types.SessionReport
        return obj.to_dict()
    raise TypeError(f"cannot encode {type(obj).__name__}")
