"""Fuzzing the body codec (msgpack, both NumPy marker flavours, JSON): typed errors only, and lossless round trips."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dreamzero_client.errors import InvalidRequest
from dreamzero_client.wire import codec
from tests.support.fuzz import CI, TARGETS_BY_NAME, assert_same_tree, encode_tree, small_arrays

CODEC = TARGETS_BY_NAME["codec"]


@settings(CI)
@given(CODEC.strategy())
def test_decoding_mutated_bodies_raises_only_typed_errors(example):
    CODEC.run(example)


@settings(CI)
@given(st.dictionaries(st.text(min_size=1, max_size=8), small_arrays(), min_size=1, max_size=4))
def test_arrays_survive_both_msgpack_flavours(tree):
    for flavour in (codec.OPENPI, codec.MSGPACK_NUMPY):
        body, ctype = codec.encode_body(tree, flavour)
        back, seen = codec.decode_body(body, ctype)
        assert seen == flavour
        for key, arr in tree.items():  # big-endian arrays come back native: same values, native byte order
            native = arr.astype(arr.dtype.newbyteorder("="))
            assert_same_tree(native, back[key])


@settings(CI)
@given(st.dictionaries(st.text(min_size=1, max_size=8), small_arrays(), min_size=1, max_size=4))
def test_arrays_survive_json_as_nested_lists(tree):
    back, seen = codec.decode_body(codec.encode_json(tree), codec.JSON_CONTENT_TYPE)
    assert seen == codec.JSON
    for key, arr in tree.items():
        np.testing.assert_array_equal(np.asarray(back[key], dtype=arr.dtype).reshape(arr.shape), arr)


def test_findings_of_the_fuzzer_stay_fixed():
    """Crashes the fuzzer found, now typed errors: a 5000-digit JSON number, a zero-size shape with huge dims."""
    for body, ctype in (
        (b"1" * 5000, codec.JSON_CONTENT_TYPE),
        (encode_tree({"x": 10**5000}, codec.JSON), codec.JSON_CONTENT_TYPE),
        (
            encode_tree(
                {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [0, *[2**31 - 1] * 5]}, "openpi"
            ),
            codec.MSGPACK_CONTENT_TYPE,
        ),
        (
            encode_tree(
                {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [2**31 - 1] * 3 + [0]}, "openpi"
            ),
            codec.MSGPACK_CONTENT_TYPE,
        ),
    ):
        try:
            codec.decode_body(body, ctype)
        except InvalidRequest as exc:
            assert str(exc)
        else:
            raise AssertionError(f"{body[:40]!r} was accepted")
