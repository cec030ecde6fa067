"""dreamzero_client.wire.codec: both NumPy marker flavours, JSON, content types, rejection of unsafe input."""

from __future__ import annotations

import json
import pickle

import msgpack
import msgpack_numpy
import numpy as np
import pytest

from dreamzero_client.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from dreamzero_client.wire import codec


def _openpi_pack(obj) -> bytes:
    """Independent re-implementation of openpi-client's packer (what RLinf and openpi clients send)."""

    def default(o):
        if isinstance(o, np.ndarray):
            return {b"__ndarray__": True, b"data": o.tobytes(), b"dtype": o.dtype.str, b"shape": o.shape}
        if isinstance(o, np.generic):
            return {b"__npgeneric__": True, b"data": o.item(), b"dtype": o.dtype.str}
        raise TypeError(type(o))

    return msgpack.packb(obj, default=default, use_bin_type=True)


def _openpi_unpack(data: bytes):
    def hook(o):
        if b"__ndarray__" in o:
            return np.ndarray(buffer=o[b"data"], dtype=np.dtype(o[b"dtype"]), shape=o[b"shape"])
        if b"__npgeneric__" in o:
            return np.dtype(o[b"dtype"]).type(o[b"data"])
        return o

    return msgpack.unpackb(data, object_hook=hook, raw=False, strict_map_key=False)


def _marker(data: bytes, dtype="<f4", shape=(2,)) -> bytes:
    return msgpack.packb(
        {"obs": {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}}, use_bin_type=True
    )


OBS = {
    "images": np.arange(2 * 1 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 1, 4, 6, 3),
    "state": np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 1, 64),
    "mask": np.array([True, False]),
    "ids": np.array([3, 7], dtype=np.int64),
    "half": np.ones(3, dtype=np.float16),
}


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].dtype == b[k].dtype, k


# 1. Round trips ---------------------------------------------------------------------------------------------------


def test_openpi_marker_from_openpi_client_decodes_and_reports_flavour():
    body = _openpi_pack({"input": {"observation": OBS, "seed": np.int64(5)}})
    obj, flavour = codec.decode_body(body, "application/msgpack")
    assert flavour == codec.OPENPI
    _assert_same(obj["input"]["observation"], OBS)
    assert obj["input"]["seed"] == 5 and isinstance(obj["input"]["seed"], np.int64)


def test_msgpack_numpy_marker_decodes_and_reports_flavour():
    body = msgpack.packb({"observation": OBS, "scalar": np.float32(2.5)}, default=msgpack_numpy.encode)
    obj, flavour = codec.decode_body(body, "application/x-msgpack")
    assert flavour == codec.MSGPACK_NUMPY
    _assert_same(obj["observation"], OBS)
    assert obj["scalar"] == np.float32(2.5) and obj["scalar"].dtype == np.float32


def test_reply_in_openpi_flavour_is_readable_by_openpi_unpacker():
    data, ctype = codec.encode_body({"actions": OBS["state"], "n": np.int32(3), "t": (1, 2)}, codec.OPENPI)
    assert ctype == "application/msgpack"
    back = _openpi_unpack(data)
    np.testing.assert_array_equal(back["actions"], OBS["state"])
    assert back["n"] == 3 and back["t"] == [1, 2]


def test_reply_in_msgpack_numpy_flavour_is_readable_by_msgpack_numpy():
    data, _ = codec.encode_body({"actions": OBS["state"], "n": np.int32(3)}, codec.MSGPACK_NUMPY)
    back = msgpack.unpackb(data, object_hook=msgpack_numpy.decode, raw=False)
    np.testing.assert_array_equal(back["actions"], OBS["state"])
    assert back["n"] == 3


@pytest.mark.parametrize("flavour", [codec.OPENPI, codec.MSGPACK_NUMPY])
def test_own_round_trip_keeps_flavour(flavour):
    data, ctype = codec.encode_body({"obs": OBS}, flavour)
    obj, seen = codec.decode_body(data, ctype)
    assert seen == flavour
    _assert_same(obj["obs"], OBS)


def test_json_round_trip_arrays_as_lists():
    data, ctype = codec.encode_body({"a": OBS["state"][0, 0, :3], "b": np.bool_(True)}, codec.JSON)
    assert ctype == "application/json"
    assert json.loads(data) == {"a": pytest.approx(OBS["state"][0, 0, :3].tolist()), "b": True}
    obj, flavour = codec.decode_body(data, "application/json; charset=utf-8")
    assert flavour == codec.JSON and isinstance(obj["a"], list)


def test_plain_msgpack_without_markers_defaults_to_openpi_and_bytes_keys_become_str():
    body = msgpack.packb({b"model": "m", "input": {b"prompt": ["x"]}}, use_bin_type=True)
    obj, flavour = codec.decode_body(body, "application/msgpack")
    assert flavour == codec.OPENPI
    assert obj == {"model": "m", "input": {"prompt": ["x"]}}


def test_decoded_arrays_are_read_only_and_big_endian_is_made_native():
    big = np.arange(4, dtype=">f4")
    obj, _ = codec.decode_msgpack(_openpi_pack({"a": big, "b": OBS["state"]}))
    assert obj["a"].dtype == np.dtype("<f4") and obj["a"].dtype.isnative
    np.testing.assert_array_equal(obj["a"], [0, 1, 2, 3])
    with pytest.raises(ValueError):
        obj["b"][0, 0, 0] = 1.0  # a view of the request body: writers must copy


def test_string_arrays_are_accepted():
    obj, _ = codec.decode_msgpack(_openpi_pack({"s": np.array(["ab", "c"])}))
    assert obj["s"].tolist() == ["ab", "c"]


# 2. Rejections ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ctype,expected",
    [("application/msgpack", codec.OPENPI), ("application/vnd.msgpack", codec.OPENPI), (None, codec.JSON),
     ("application/json", codec.JSON), ("application/problem+json", codec.JSON)],
)  # fmt: skip
def test_content_type_routing(ctype, expected):
    assert codec.flavour_for_content_type(ctype) == expected


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "image/png"])
def test_unsupported_content_type_is_415(ctype):
    with pytest.raises(UnsupportedMediaType, match="Content-Type"):
        codec.decode_body(b"{}", ctype)


@pytest.mark.parametrize(
    "body,match",
    [
        (_marker(b"\x00" * 7), r"'obs'.*7 bytes.*needs 8"),
        (_marker(b"\x00" * 8, shape=(-2,)), r"'obs'.*dims must be integers >= 0"),
        (_marker(b"", shape=(0, 2**40)), r"'obs'.*dims must be"),
        (_marker(b"\x00" * 8, shape=[1] * 40), r"'obs'.*at most 32"),
        (_marker(b"\x00" * 8, shape="2"), r"'obs'.*shape must be a list"),
        (_marker(b"\x00" * 16, dtype="<c8"), r"'obs'.*not accepted"),
        (_marker(b"\x00" * 8, dtype="|O"), r"'obs'.*not accepted"),
        (_marker(b"\x00" * 8, dtype="|V8"), r"'obs'.*not accepted"),
        (_marker(b"\x00" * 8, dtype="<M8[s]"), r"'obs'.*not accepted"),
        (_marker(b"\x00" * 8, dtype="(2,)<i4"), r"'obs'.*not accepted"),
        (_marker(b"\x00" * 8, dtype="nonsense"), r"'obs'.*unknown array dtype"),
        (_marker("text"), r"'obs'.*raw bytes"),
        (msgpack.packb({"a": [{b"__ndarray__": True, b"data": b""}]}, use_bin_type=True), r"'a\[0\]'.*malformed"),
        (msgpack.packb({"x": {b"__npgeneric__": True, b"data": [1], b"dtype": "<i4"}}), r"'x'.*scalar data"),
        (msgpack.packb({1: 2}), r"must be a string"),
        (msgpack.packb(msgpack.ExtType(5, b"zz")), r"extension type 5"),
        (b"\xc1", r"not valid msgpack"),
        (msgpack.packb({"a": 1}) + b"\x01", r"not valid msgpack"),
        (b"", r"empty request body"),
    ],
)
def test_malformed_msgpack_is_rejected_naming_the_path(body, match):
    with pytest.raises(InvalidRequest, match=match):
        codec.decode_body(body, "application/msgpack")


def test_object_arrays_are_never_unpickled(tmp_path):
    # msgpack-numpy sends object arrays as a pickle; decoding it would run attacker code
    sentinel = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    body = msgpack.packb(
        {"obs": {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1], b"data": pickle.dumps(Evil())}}
    )
    with pytest.raises(InvalidRequest, match=r"'obs'.*kind"):
        codec.decode_body(body, "application/msgpack")
    assert not sentinel.exists()


def test_complex_marker_of_msgpack_numpy_is_rejected():
    body = msgpack.packb({"z": complex(1, 2)}, default=msgpack_numpy.encode)
    with pytest.raises(InvalidRequest, match=r"'z'.*complex"):
        codec.decode_body(body, "application/msgpack")


@pytest.mark.parametrize("body", [b"{", b"\xff\xfe", b""])
def test_malformed_json_is_rejected(body):
    with pytest.raises(InvalidRequest):
        codec.decode_body(body, "application/json")


def test_encoding_object_arrays_fails_loudly():
    with pytest.raises(TypeError):
        codec.encode_msgpack({"a": np.array([object()], dtype=object)})


def test_size_limit_and_nesting_depth():
    with pytest.raises(PayloadTooLarge, match="at most 10 bytes"):
        codec.decode_body(b"x" * 11, "application/msgpack", max_bytes=10)
    deep: list = [1]
    for _ in range(200):
        deep = [deep]
    with pytest.raises(InvalidRequest, match="nested more than 64"):
        codec.decode_body(msgpack.packb({"a": deep}), "application/msgpack")
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        codec.decode_body(b"[" * 100000 + b"]" * 100000, "application/json")
