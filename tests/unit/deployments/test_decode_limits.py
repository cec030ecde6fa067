"""Decode limits (issue 45): bomb bodies are refused, naming the limit, before they build a large object graph;
legal requests (markers, a JSON frame as nested lists) pass; large bodies decode off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import tracemalloc

import msgpack
import numpy as np
import pytest

from deployments.requests import limits as server_limits
from deployments.requests.generations import parse_generation_request
from dreamzero_client.errors import InvalidRequest
from dreamzero_client.wire import codec

SMALL = codec.DecodeLimits(max_bytes=1 << 20, max_depth=8, max_container_len=100, max_objects=1000)


def _array32(items: bytes, n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + items * n


def _tree(leaf: bytes, fan: int, levels: int) -> bytes:
    """A msgpack list tree: `levels` levels of `fan` lists above `fan` leaves each."""
    node = b"\xdc" + fan.to_bytes(2, "big") + leaf * fan
    for _ in range(levels):
        node = b"\xdc" + fan.to_bytes(2, "big") + node * fan
    return b"\x81\xa5input" + node


@pytest.mark.parametrize("leaf", [b"\x90", b"\x80", b"\xe0", b"\xa2ab"], ids=["lists", "maps", "negint", "str"])
def test_msgpack_bombs_stop_at_max_objects(leaf):
    body = _tree(leaf, 50, 2)  # 125,000 leaves under 2,551 lists: past 1000 values, within each container's 100
    with pytest.raises(InvalidRequest, match="max_objects"):
        codec.decode_body(body, "application/msgpack", limits=SMALL)


def test_msgpack_long_container_is_refused_before_it_is_allocated():
    # a 5-byte header claiming 2**30 items: msgpack would otherwise preallocate the list the header claims
    tracemalloc.start()
    with pytest.raises(InvalidRequest, match="max_container_len"):
        codec.decode_body(b"\x81\xa5input" + _array32(b"\x90", 1000), "application/msgpack", limits=SMALL)
    with pytest.raises(InvalidRequest, match="max_container_len"):
        codec.decode_msgpack(b"\xdd\x40\x00\x00\x00" + b"\x90" * 1000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


def test_msgpack_depth_limit_is_named():
    deep: list = []
    for _ in range(9):
        deep = [deep]
    with pytest.raises(InvalidRequest, match=r"nested more than 8 levels deep \(max_depth\)"):
        codec.decode_body(msgpack.packb({"a": deep}), "application/msgpack", limits=SMALL)


@pytest.mark.parametrize("unit", [b"[]", b"{}", b"[[[[]]]]", b"1", b'"ab"', b'{"k":1}'])
def test_json_bombs_stop_at_max_objects_before_parsing(unit):
    body = b'{"input":[' + b",".join([unit] * 2000) + b"]}"
    tracemalloc.start()
    with pytest.raises(InvalidRequest, match="max_objects"):
        codec.decode_body(body, "application/json", limits=SMALL)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < len(body) + (64 << 10)  # the pre-scan builds nothing


def test_json_depth_and_container_limits_are_named():
    deep = b"[" * 9 + b"]" * 9
    with pytest.raises(InvalidRequest, match="max_depth"):
        codec.decode_body(b'{"a":' + deep + b"}", "application/json", limits=SMALL)
    wide = json.dumps({"a": list(range(101))}).encode()
    with pytest.raises(InvalidRequest, match="max_container_len"):
        codec.decode_body(wide, "application/json", limits=SMALL)


def test_limits_fit_the_widest_legal_request():
    limits = server_limits.request_limits(max_rows=4, max_cameras=2, max_frames=4, frame_hw=(24, 32))
    # every row's frames as markers, and one row's frames as nested lists (JSON's form)
    frames = np.zeros((4, 2, 4, 24, 32, 3), np.uint8)
    body = {
        "input": {
            "prompt": ["go"] * 4,
            "observation": {f"video.cam{c}": frames[:, c] for c in range(2)} | {"state.joint": np.zeros((4, 7))},
        },
        "parameters": {"session_ids": [f"s{i}" for i in range(4)], "seed": [1, 2, 3, 4], "reset_mask": [True] * 4},
    }
    packed, ctype = codec.encode_body(body)
    obj, _ = codec.decode_body(packed, ctype, limits=limits)
    assert obj["input"]["observation"]["video.cam0"].shape == (4, 4, 24, 32, 3)
    one_row = dict(body, parameters={"session_ids": ["s0"]})
    one_row["input"] = {"prompt": ["go"], "observation": {f"video.cam{c}": frames[:1, c] for c in range(2)}}
    as_json = codec.encode_json(one_row)
    obj = codec.decode_body(as_json, "application/json", limits=limits)[0]
    req = parse_generation_request(obj, codec.JSON)
    assert req.observation["video.cam1"].shape == (1, 4, 24, 32, 3)
    # a second JSON row's frames pass the widest request, and are refused
    two_rows = dict(one_row, parameters={"session_ids": ["s0", "s1"]})
    two_rows["input"] = {"prompt": ["go"] * 2, "observation": {f"video.cam{c}": frames[:2, c] for c in range(2)}}
    with pytest.raises(InvalidRequest, match="max_objects"):
        codec.decode_body(codec.encode_json(two_rows), "application/json", limits=limits)


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="max_objects"):
        codec.DecodeLimits(max_objects=0)
    assert codec.DecodeLimits() == server_limits.request_limits()


def test_shape_error_quotes_a_long_shape_list_briefly():
    shape = list(range(1_000_000))
    body = msgpack.packb({"a": {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": shape}})
    limits = codec.DecodeLimits(max_container_len=2_000_000, max_objects=3_000_000)
    with pytest.raises(InvalidRequest) as err:
        codec.decode_body(body, "application/msgpack", limits=limits)
    assert "1000000 items" in str(err.value) and len(str(err.value)) < 300


def test_large_bodies_decode_on_a_worker_thread():
    loop_thread = threading.get_ident()
    seen = []

    def decode(body):
        seen.append(threading.get_ident())
        return codec.decode_body(body, "application/msgpack")

    big = codec.encode_msgpack({"x": np.zeros(server_limits.INLINE_DECODE_BYTES, np.uint8)})
    small = codec.encode_msgpack({"x": 1})

    async def main():
        await server_limits.decode_in_worker(len(small), decode, small)
        obj, _ = await server_limits.decode_body_async(big, "application/msgpack")
        await server_limits.decode_in_worker(len(big), decode, big)
        return obj

    obj = asyncio.run(main())
    assert obj["x"].size == server_limits.INLINE_DECODE_BYTES
    assert seen[0] == loop_thread and seen[1] != loop_thread
