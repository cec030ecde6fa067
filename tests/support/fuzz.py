"""Hypothesis strategies and fuzz targets for the wire protocol and the Franka safety layer.

Shared by the unit tests (`test_fuzz_*.py`, the ``ci`` profile: a few hundred examples per target, derandomized)
and `benchmarks/fuzz.py` (the ``fuzz`` profile: 10,000 per target, and the live-server mode).

Strategies start from *valid* bodies and frames and mutate them, so examples get past the first checks and reach
the deep ones: a wrong type at any path, a deleted or extra key, arrays with other dtypes, shapes, NaN/inf or huge
dims, hand-made NumPy markers (consistent or not), then optionally damaged bytes (truncated, flipped, spliced).

A target returns ``"accepted"`` or ``"rejected"`` (a `DreamZeroError`: the project's typed errors); any other
exception is a crash, and an `AssertionError` is a broken invariant.
"""
# Longer than ~400 lines on purpose: the strategies are shared by every fuzz target, the CI tests and
# benchmarks/fuzz.py.

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from deployments.requests.generations import DEFAULT_MAX_STATE_DIM, NORMALISED_FRAME_COUNTS, parse_generation_request
from deployments.requests.openpi import OPENPI_ENDPOINTS, parse_openpi_request
from dreamzero_client.errors import DreamZeroError
from dreamzero_client.wire import codec, generations, openpi
from dreamzero_droid import droid
from dreamzero_droid.policy import validate_chunk
from dreamzero_franka.common.limits import DROID_HOME
from dreamzero_franka.droid import safety
from tests.support.observations import openpi_droid_observation

# 1. Profiles ---------------------------------------------------------------------------------------------------------

_COMMON = dict(
    derandomize=True,  # the same examples on every run: CI never flakes on a new random draw
    deadline=None,  # a slow example on a loaded 2-core machine is not a failure
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile("ci", max_examples=300, **_COMMON)
#: benchmarks/fuzz.py: many examples, no shrinking (crashes are recorded, not raised)
settings.register_profile("fuzz", max_examples=10_000, phases=[Phase.generate], **_COMMON)
CI = settings.get_profile("ci")

# 2. Leaf values: the wrong types a path may get -----------------------------------------------------------------------

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
#: ints at and beyond the msgpack / int64 / JSON-digit limits (10**5000 has more digits than Python parses by default)
EDGE_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, UINT64_MAX, INT64_MIN, 2**64, 10**400, 10**5000]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308, -1e300]
#: dtype strings a sender may put in a marker: accepted ones, refused kinds, malformed and absurd ones
DTYPE_STRINGS = [
    "<f4", ">f4", "<f8", "<f2", "|u1", "|i1", "<i8", ">i8", "<u8", "|b1", "?", "|S3", "<U2", ">U1", "|S0", "<U0",
    "|O", "<c8", "<c16", "|V8", "<M8[s]", "<m8", "f4,f4", "(2,)i4", "<q9", "", "float", "T", "i4=", "<U99999999999",
    "a", "S", "object", "int", "\x00", "<f4" * 9,
]  # fmt: skip
ARRAY_DTYPES = [np.bool_, np.uint8, np.int8, np.int32, np.int64, np.uint64, np.float16, np.float32, np.float64]


def scalars() -> st.SearchStrategy:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from(EDGE_INTS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(EDGE_FLOATS),
        st.text(max_size=12),
        st.binary(max_size=12),
    )


def small_arrays() -> st.SearchStrategy:
    """Arrays of any accepted dtype and small shape, values including NaN/inf and the dtype's extremes."""

    @st.composite
    def build(draw):
        dtype = np.dtype(draw(st.sampled_from(ARRAY_DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=5)))
        n = math.prod(shape)
        if dtype.kind == "f":
            values = draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, *EDGE_FLOATS]), min_size=n, max_size=n))
            with np.errstate(over="ignore", invalid="ignore"):
                arr = np.array(values, dtype=np.float64).astype(dtype)
        elif dtype.kind == "b":
            arr = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=dtype)
        else:
            info = np.iinfo(dtype)
            values = draw(st.lists(st.sampled_from([0, 1, int(info.min), int(info.max)]), min_size=n, max_size=n))
            arr = np.array(values, dtype=dtype)
        arr = arr.reshape(shape)
        return arr.astype(arr.dtype.newbyteorder(">")) if draw(st.booleans()) and dtype.itemsize > 1 else arr

    return build()


@st.composite
def ndarray_markers(draw) -> dict:
    """An openpi or msgpack-numpy marker, built by hand: often consistent (data length matches), often not."""
    dtype = draw(st.sampled_from(DTYPE_STRINGS))
    shape: Any = draw(
        st.one_of(
            st.lists(st.integers(0, 5), max_size=4),
            st.lists(st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**40]), max_size=34),  # huge, negative, too many
            scalars(),
        )
    )
    size = -1  # an absurd dtype or shape: any data will do
    if isinstance(shape, list) and all(type(d) is int for d in shape):
        try:
            size = np.dtype(dtype).itemsize * math.prod(shape)
        except (TypeError, ValueError, SyntaxError):
            pass
    data = (
        b"\x00" * size
        if 0 <= size <= 4096 and draw(st.booleans())
        else draw(st.one_of(st.binary(max_size=64), scalars()))
    )
    key = draw(st.sampled_from([lambda k: k.encode(), lambda k: k]))  # openpi's bytes keys, or str keys
    flavour = draw(st.sampled_from(["openpi", "scalar", "msgpack_numpy", "complex"]))
    if flavour == "openpi":
        marker = {"__ndarray__": draw(st.sampled_from([True, True, False, 1, None])), "data": data, "dtype": dtype}
        marker["shape"] = shape
    elif flavour == "scalar":
        marker = {"__npgeneric__": True, "data": draw(scalars()), "dtype": dtype}
    elif flavour == "msgpack_numpy":
        kind = draw(st.sampled_from([b"", "", b"O", b"V", 3]))
        marker = {"nd": draw(st.sampled_from([True, False, 0, None])), "type": dtype, "kind": kind, "data": data}
        marker["shape"] = shape
    else:
        marker = {"complex": True, "data": data}
    for k in draw(st.lists(st.sampled_from(sorted(marker)), max_size=2, unique=True)):  # sometimes a key goes missing
        del marker[k]
    return {key(k): v for k, v in marker.items()}


def wrong_values() -> st.SearchStrategy:
    """Anything a path may be replaced by: scalars, arrays, containers, markers, very deep nesting."""
    return st.one_of(
        scalars(),
        small_arrays(),
        ndarray_markers(),
        st.lists(scalars(), max_size=4),
        st.lists(st.lists(st.integers(-3, 300), max_size=3), max_size=3),  # possibly ragged
        st.dictionaries(st.text(max_size=6), scalars(), max_size=3),
        st.integers(1, 80).map(lambda d: _nest(d, list)),
        st.integers(1, 80).map(lambda d: _nest(d, dict)),
    )


def _nest(depth: int, kind: type) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v] if kind is list else {"k": v}
    return v


# 3. Tree mutations of a valid body ----------------------------------------------------------------------------------

#: keys that mean something somewhere in the protocol: an added key is often one of these
MEANINGFUL_KEYS = [
    "__ndarray__", "__npgeneric__", "nd", "complex", "data", "dtype", "shape", "images", "state", "state_mask",
    "embodiment_id", "form", "seed", "session_ids", "reset_mask", "expected_steps", "expected_incarnations",
    "routing_key", "endpoint", "session_id", "prompt", "response_format", "state.joint_position",
    "video.wrist_image_left", "observation/joint_position", "observation/wrist_image_left", "",
]  # fmt: skip


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _paths(v, (*prefix, i))
    return out


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(tree, path[:-1])[path[-1]] = value
    return tree


def _array_mutation(draw, arr: np.ndarray) -> Any:
    """Another dtype, another shape, poisoned values or an inconsistent marker for this array."""
    how = draw(st.sampled_from(["dtype", "shape", "poison", "marker", "empty", "list"]))
    if how == "dtype":
        target = np.dtype(draw(st.sampled_from([*ARRAY_DTYPES, "<U3", "|S2", ">f4", ">i8"])))
        with np.errstate(all="ignore"):
            return arr.astype(target)
    if how == "shape":
        kind = draw(st.sampled_from(["add", "drop", "flat", "swap", "row"]))
        if kind == "add":
            return arr[None]
        if kind == "drop" and arr.ndim:
            return arr[0] if arr.shape[0] else arr.reshape(arr.shape[1:] or (0,))[:0]
        if kind == "swap" and arr.ndim >= 2:
            return np.swapaxes(arr, 0, -1)
        if kind == "row" and arr.ndim:
            return np.concatenate([arr, arr[:1]]) if arr.shape[0] else arr
        return arr.reshape(-1)
    if how == "poison" and arr.size:
        out = arr.astype(np.float32) if arr.dtype.kind != "f" else arr.copy()
        out.flat[draw(st.integers(0, arr.size - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e30]))
        return out
    if how == "marker":
        huge = draw(st.permutations([0, *[2**31 - 1] * draw(st.integers(1, 5))]))  # zero-size, yet overflowing
        shape = draw(st.sampled_from([huge, [-1, *arr.shape], [*arr.shape, 2], list(arr.shape)]))
        data = draw(st.sampled_from([b"", arr.tobytes()[:-1], arr.tobytes() + b"\x00", arr.tobytes()]))
        return {b"__ndarray__": True, b"data": data, b"dtype": arr.dtype.str, b"shape": shape}
    if how == "empty":
        return arr[:0]
    return arr.tolist()


@st.composite
def mutated(draw, valid: Any, max_mutations: int = 3) -> Any:
    """`valid` (a decoded body or frame) with 1..max_mutations mutations at paths anywhere in the tree."""
    tree = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, max_mutations))):
        paths = _paths(tree)
        path = draw(st.sampled_from(paths))
        node = _get(tree, path)
        ops = ["replace", "wrap"]
        if path:
            ops.append("delete")
        if isinstance(node, dict):
            ops.append("add_key")
        if isinstance(node, np.ndarray):
            ops += ["array", "array"]
        op = draw(st.sampled_from(ops))
        if op == "replace":
            tree = _set(tree, path, draw(wrong_values()))
        elif op == "wrap":
            tree = _set(tree, path, draw(st.sampled_from([lambda v: [v], lambda v: {"x": v}, lambda v: [v, v]]))(node))
        elif op == "delete":
            parent = _get(tree, path[:-1])
            del parent[path[-1]]
        elif op == "add_key":
            node[draw(st.one_of(st.sampled_from(MEANINGFUL_KEYS), st.text(max_size=8)))] = draw(wrong_values())
        else:
            tree = _set(tree, path, _array_mutation(draw, node))
    return tree


# 4. Bytes: encoding a tree in any flavour, then damaging it -----------------------------------------------------------


def _msgpack_safe(obj: Any) -> Any:
    """msgpack cannot pack ints outside [-2**63, 2**64); such ints travel as floats (JSON keeps them)."""
    if isinstance(obj, bool) or not isinstance(obj, (int, dict, list)):
        return obj
    if isinstance(obj, int):
        return obj if INT64_MIN <= obj <= UINT64_MAX else float("inf") if obj > 0 else float("-inf")
    if isinstance(obj, dict):
        return {k: _msgpack_safe(v) for k, v in obj.items()}
    return [_msgpack_safe(v) for v in obj]


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bytes):
        return obj.decode("latin-1")
    raise TypeError(type(obj).__name__)


_BIG_INT = "__fuzz_big_int__"


def _json_keys(obj: Any) -> Any:
    """Bytes keys become text; ints too long for `str()` become a placeholder `encode_tree` spells out."""
    if isinstance(obj, int) and not isinstance(obj, bool) and obj.bit_length() > 13_000:
        return _BIG_INT
    if isinstance(obj, dict):
        return {(k.decode("latin-1") if isinstance(k, bytes) else k): _json_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_keys(v) for v in obj]
    return obj


def encode_tree(tree: Any, flavour: str) -> bytes:
    """Encode a (possibly mutated) tree the way a client of that flavour would; never fails."""
    if flavour == codec.JSON:
        text = json.dumps(_json_keys(tree), default=_json_default).replace(f'"{_BIG_INT}"', "1" * 5000)
        return text.encode("utf-8", "surrogatepass")
    default = codec._openpi_default if flavour == codec.OPENPI else codec._msgpack_numpy_default
    return msgpack.packb(_msgpack_safe(tree), default=default, use_bin_type=True)


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """Usually the bytes as they are; else truncated, a byte flipped, bytes inserted or a tail spliced in."""
    how = draw(st.sampled_from(["none", "none", "none", "truncate", "flip", "insert", "splice"]))
    if how == "none" or not data:
        return data
    i = draw(st.integers(0, len(data) - 1))
    if how == "truncate":
        return data[:i]
    if how == "flip":
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    if how == "insert":
        return data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
    j = draw(st.integers(0, len(data) - 1))
    return data[:i] + data[j:]


CONTENT_TYPES = [
    codec.MSGPACK_CONTENT_TYPE, "application/x-msgpack", "application/vnd.msgpack", codec.JSON_CONTENT_TYPE,
    "application/json; charset=utf-8", "application/problem+json", "", None, "text/plain", "multipart/form-data",
    "APPLICATION/MSGPACK", ";;;", "application/json;msgpack",
]  # fmt: skip


@st.composite
def wire_bodies(draw, valid_trees: st.SearchStrategy) -> tuple[bytes, str | None]:
    """``(body bytes, content type)``: a mutated valid tree in a random flavour, possibly damaged; or plain noise."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=256)), draw(st.sampled_from(CONTENT_TYPES))
    flavour = draw(st.sampled_from(codec.FLAVOURS))
    valid = draw(valid_trees)
    tree = valid if draw(st.integers(0, 5)) == 0 else draw(mutated(valid))
    body = draw(damaged(encode_tree(tree, flavour)))
    ctype = codec.content_type_for(flavour) if draw(st.integers(0, 5)) else draw(st.sampled_from(CONTENT_TYPES))
    return body, ctype


# 5. Valid seeds -------------------------------------------------------------------------------------------------------


@st.composite
def normalised_bodies(draw, image_hw: tuple[int, int] | None = None, max_batch: int = 3) -> dict:
    """A valid RLinf normalised-form body (B in 1..max_batch, T in 1|4), as the client builds it."""
    b = draw(st.integers(1, max_batch))
    t = draw(st.sampled_from(NORMALISED_FRAME_COUNTS))
    h, w = image_hw or (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    mask = np.zeros((b, 1, DEFAULT_MAX_STATE_DIM), bool)
    mask[..., :8] = True
    obs = {
        "images": rng.integers(0, 256, (b, t, h, w, 3), dtype=np.uint8),
        "state": (rng.uniform(-1, 1, mask.shape) * mask).astype(np.float32),
        "state_mask": mask,
        "embodiment_id": np.full((b,), 17, np.int64),
    }
    if draw(st.booleans()):
        obs["has_lapa_action"] = np.zeros((b,), bool)
    return _body(draw, obs, b)


@st.composite
def raw_droid_bodies(draw, image_hw: tuple[int, int] = (4, 6), max_batch: int = 3) -> dict:
    """A valid raw-form DROID body; the unit fuzz uses tiny images (`validate_raw` checks structure only)."""
    b = draw(st.integers(1, max_batch))
    t = draw(st.sampled_from([1, 4]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    obs: dict[str, Any] = {
        f"video.{view}": rng.integers(0, 256, (b, t, *image_hw, 3), dtype=np.uint8)
        for view in ("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left")
    }
    obs["state.joint_position"] = rng.uniform(-1, 1, (b, 7)).astype(np.float32)
    obs["state.gripper_position"] = rng.uniform(0, 1, (b, 1)).astype(np.float32)
    if draw(st.booleans()):  # the nested spelling of the same keys
        obs = {"video": {k[6:]: v for k, v in obs.items() if k.startswith("video.")}, "state": {
            k[6:]: v for k, v in obs.items() if k.startswith("state.")}}  # fmt: skip
    return _body(draw, obs, b, form=draw(st.sampled_from([None, "raw"])))


def _body(draw, obs: dict, b: int, form: str | None = None) -> dict:
    ids = [f"s{i}" for i in range(b)]
    kwargs: dict[str, Any] = {}
    if draw(st.booleans()):
        kwargs["reset_mask"] = [False] * b
    if draw(st.booleans()):
        kwargs["seed"] = draw(st.sampled_from([0, 1140, [1] * b]))
    if draw(st.booleans()):
        kwargs["expected_steps"] = [draw(st.sampled_from([None, 0, 3])) for _ in range(b)]
    if draw(st.booleans()):
        kwargs["expected_incarnations"] = [draw(st.sampled_from([None, "abc123"])) for _ in range(b)]
    if draw(st.booleans()):
        kwargs["negative_prompts"] = ["blurry"] * b
    if draw(st.booleans()):
        kwargs["routing_key"] = "route"
    return generations.build_request_body(obs, ["pick up the cup"] * b, ids, form=form, **kwargs)


def generation_bodies(image_hw: tuple[int, int] | None = None, max_batch: int = 3) -> st.SearchStrategy:
    """Both forms; `image_hw` sizes the raw form's cameras (the live fuzz sends DROID's real 180x320)."""
    return st.one_of(normalised_bodies(max_batch=max_batch), raw_droid_bodies(image_hw or (4, 6), max_batch=max_batch))


@st.composite
def openpi_frames(draw, image_hw: tuple[int, int] = (4, 6)) -> dict:
    """A valid OpenPI DROID frame (infer, one or four camera frames; or a reset)."""
    if draw(st.integers(0, 7)) == 0:
        return {"endpoint": "reset", "session_id": "ws0"}
    seed = draw(st.integers(0, 2**16))
    frames = 4 if draw(st.booleans()) else None
    frame = openpi_droid_observation(seed, "ws0", frames=frames, hw=image_hw, gripper=0.2)
    for key, values in (("endpoint", ["infer"]), ("seed", [0, 7]), ("response_format", ["dict", "array"])):
        if draw(st.booleans()):
            frame[key] = draw(st.sampled_from(values))
    return frame


@st.composite
def openpi_wire_frames(draw, image_hw: tuple[int, int] = (4, 6)) -> bytes | str:
    """What may arrive on the socket: a mutated (sometimes valid) frame, damaged bytes, noise or a text frame."""
    pick = draw(st.integers(0, 19))
    if pick == 0:
        return draw(st.text(max_size=32))
    if pick == 1:
        return draw(st.binary(max_size=256))
    frame = draw(openpi_frames(image_hw))
    if pick > 4:
        frame = draw(mutated(frame))
    flavour = draw(st.sampled_from([codec.OPENPI, codec.MSGPACK_NUMPY]))
    return draw(damaged(encode_tree(frame, flavour)))


# 6. Targets: what each fuzzed example is run through ------------------------------------------------------------------

MAX_BYTES = 1 << 20


def run_codec(example: tuple[bytes, str | None]) -> str:
    """decode_body; a decoded tree must re-encode and decode to the same tree (no marker survives as a dict)."""
    body, ctype = example
    try:
        obj, flavour = codec.decode_body(body, ctype, max_bytes=MAX_BYTES)
    except DreamZeroError:
        return "rejected"
    assert flavour in codec.FLAVOURS
    if flavour != codec.JSON:
        again, _ = codec.decode_msgpack(codec.encode_msgpack(obj, flavour))
        assert_same_tree(obj, again)
    return "accepted"


def assert_same_tree(a: Any, b: Any, path: str = "<body>") -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert type(a) is type(b) and (a == b or (a != a and b != b)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert type(a) is type(b) and a == b, path


def run_generation(example: tuple[bytes, str | None]) -> str:
    """decode_body -> parse_generation_request, as the server does; an accepted request must be self-consistent."""
    body, ctype = example
    try:
        obj, flavour = codec.decode_body(body, ctype, max_bytes=MAX_BYTES)
        req = parse_generation_request(obj, flavour, max_batch=8)
    except DreamZeroError:
        return "rejected"
    b = req.batch_size
    assert 1 <= b <= 8 and len(set(req.session_ids)) == b
    assert len(req.prompts) == b and len(req.rows.reset_mask) == b
    assert all(isinstance(p, str) for p in req.prompts)
    for name, seq in (("seeds", req.rows.seeds), ("expected_steps", req.rows.expected_steps)):
        assert seq is None or len(seq) == b, name
    for key, arr in req.observation.items():
        assert isinstance(arr, np.ndarray) and arr.ndim >= 1 and arr.shape[0] == b, key
    if req.form == "normalised":
        assert req.observation["images"].dtype == np.uint8 and req.observation["images"].ndim == 5
        assert np.isfinite(req.observation["state"]).all()
    return "accepted"


def run_openpi(frame: bytes | str) -> str:
    """unpack_frame -> parse_openpi_request, as the WebSocket handler does."""
    try:
        msg, flavour = openpi.unpack_frame(frame, max_bytes=MAX_BYTES)
        req = parse_openpi_request(msg, flavour)
    except DreamZeroError:
        return "rejected"
    assert req.endpoint in OPENPI_ENDPOINTS and isinstance(req.session_id, str) and req.session_id
    assert req.endpoint == "reset" or isinstance(req.prompt, str)
    assert all(isinstance(v, np.ndarray) for v in req.observation.values())
    return "accepted"


# 7. The safety layer ---------------------------------------------------------------------------------------------


@st.composite
def safety_configs(draw) -> safety.SafetyConfig:
    kwargs: dict[str, Any] = dict(
        joint_margin_rad=draw(st.floats(0, 0.3)),
        max_step_rad=draw(st.floats(1e-4, 0.5)),
        control_hz=draw(st.floats(1, 1000)),
        gripper_threshold=draw(st.floats(0.05, 0.95)),
    )
    if draw(st.booleans()):
        center = np.array([draw(st.floats(-0.5, 0.8)), draw(st.floats(-0.6, 0.6)), draw(st.floats(0.0, 0.9))])
        half = np.array([draw(st.floats(0.05, 0.6)) for _ in range(3)])
        kwargs.update(workspace_min=tuple(center - half), workspace_max=tuple(center + half))
    return safety.SafetyConfig(**kwargs)


CHUNK_VALUES = [0.0, 0.3, -0.3, 1.0, -3.0, 3.0, 10.0, -1e6, 1e300, -1e308, 5e-324, math.nan, math.inf, -math.inf]


@st.composite
def chunks(draw) -> Any:
    """What a server (or a broken link) may hand the robot as actions: mostly (H, 8) arrays, some of them not."""
    pick = draw(st.integers(0, 9))
    if pick == 0:
        return draw(st.one_of(scalars(), st.lists(st.floats(), max_size=8), small_arrays()))
    if pick == 1:  # a wrong shape
        shape = draw(st.sampled_from([(0, 8), (3, 7), (8,), (2, 8, 1), (1, 9), (24, 14)]))
        return np.zeros(shape, np.float32)
    if pick == 2:  # a wrong dtype
        dtype = draw(st.sampled_from([object, np.complex64, "<U3", bool]))
        return np.zeros((4, droid.ACTION_DIM), dtype=dtype)
    h = draw(st.integers(1, 30))
    base = np.array(DROID_HOME_8, np.float64) + draw(st.floats(-0.5, 0.5))
    rows = np.tile(base, (h, 1))
    for _ in range(draw(st.integers(0, 12))):
        rows[draw(st.integers(0, h - 1)), draw(st.integers(0, 7))] = draw(
            st.one_of(st.sampled_from(CHUNK_VALUES), st.floats(-10, 10))
        )
    dtype = draw(st.sampled_from([np.float64, np.float32, np.float16, np.int64]))
    with np.errstate(all="ignore"):
        return rows.astype(dtype) if dtype is not np.int64 or np.isfinite(rows).all() else rows


DROID_HOME_8 = [*DROID_HOME, 0.0]


@st.composite
def safety_cases(draw) -> tuple[safety.SafetyConfig, Any, np.ndarray, bool]:
    """(config, chunk, measured start position, whether the arm tracks commands exactly or drifts)."""
    cfg = draw(safety_configs())
    if draw(st.integers(0, 4)):
        measured = np.array([draw(st.floats(lo, hi)) for lo, hi in zip(cfg.lower, cfg.upper)])
    else:  # the arm starts slightly outside the margin (or the hardware limit)
        measured = np.array([draw(st.floats(lo - 0.3, hi + 0.3)) for lo, hi in zip(cfg.lower, cfg.upper)])
    return cfg, draw(chunks()), measured, draw(st.booleans())


def run_safety(example: tuple[safety.SafetyConfig, Any, np.ndarray, bool]) -> str:
    """validate_chunk, then every row through the filter: each command stays within every limit.

    Per joint: inside [lower, upper] (or, for a joint already outside, no further out than where it starts), at most
    one step limit from the previous command, and the TCP never further outside the workspace than before.
    """
    cfg, chunk, measured, tracks = example
    filt = safety.SafetyFilter(cfg)
    try:
        actions = validate_chunk(chunk)
    except DreamZeroError:
        return "rejected"
    assert actions.dtype == np.float64 and actions.shape[1] == droid.ACTION_DIM and np.isfinite(actions).all()
    arm = measured.copy()
    ref = measured.copy()
    for row in actions:
        cmd = filt.filter(row[:7], arm).joint_targets
        assert cmd.shape == (7,) and np.isfinite(cmd).all()
        eps = 1e-9
        assert np.all(np.abs(cmd - ref) <= cfg.step_limit + eps), (cmd - ref, cfg.step_limit)
        assert np.all(cmd >= np.minimum(cfg.lower, ref) - eps) and np.all(cmd <= np.maximum(cfg.upper, ref) + eps)
        inside = (ref >= cfg.lower) & (ref <= cfg.upper)
        assert np.all((cmd[inside] >= cfg.lower[inside] - eps) & (cmd[inside] <= cfg.upper[inside] + eps))
        assert filt.workspace_violation(cmd) <= filt.workspace_violation(ref) + 1e-6
        assert droid.binarize_gripper(row[7], cfg.gripper_threshold) in (0.0, 1.0)
        ref = cmd
        arm = cmd if tracks else cmd + 1e-4  # a real arm lags a little; the filter steps from its last command
    return "accepted"


@st.composite
def filter_calls(draw) -> tuple[Any, Any]:
    """Direct `SafetyFilter.filter` inputs: targets / positions of any shape, type and value."""
    vec = st.one_of(
        st.lists(st.sampled_from(CHUNK_VALUES), min_size=7, max_size=7).map(np.array),
        st.lists(st.floats(), max_size=9),
        small_arrays(),
        scalars(),
    )
    return draw(vec), draw(st.one_of(st.just(DROID_HOME.copy()), vec))


def run_filter(example: tuple[Any, Any]) -> str:
    target, measured = example
    try:
        cmd = safety.SafetyFilter().filter(target, measured).joint_targets
    except DreamZeroError:
        return "rejected"
    assert cmd.shape == (7,) and np.isfinite(cmd).all()
    return "accepted"


# 8. The registry benchmarks/fuzz.py and the tests iterate over --------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    strategy: Callable[[], st.SearchStrategy]
    run: Callable[[Any], str]
    what: str


TARGETS = [
    Target("codec", lambda: wire_bodies(generation_bodies()), run_codec, "codec.decode_body + re-encode round trip"),
    Target("generations", lambda: wire_bodies(generation_bodies()), run_generation,
           "decode_body -> parse_generation_request (normalised and raw forms)"),
    Target("openpi", openpi_wire_frames, run_openpi, "unpack_frame -> parse_openpi_request"),
    Target("safety_chunks", safety_cases, run_safety, "validate_chunk -> SafetyFilter.filter per row, limits held"),
    Target("safety_filter", filter_calls, run_filter, "SafetyFilter.filter with arbitrary targets / positions"),
]  # fmt: skip
TARGETS_BY_NAME = {t.name: t for t in TARGETS}
