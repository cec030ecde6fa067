"""Fuzzing OpenPI WebSocket frames: `unpack_frame` then `parse_openpi_request`, as the WebSocket handler runs them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.requests.openpi import parse_openpi_request
from dreamzero_client.errors import DreamZeroError
from tests.support.fuzz import CI, TARGETS_BY_NAME, scalars

OPENPI = TARGETS_BY_NAME["openpi"]


@settings(CI)
@given(OPENPI.strategy())
def test_mutated_frames_raise_only_typed_errors(frame):
    OPENPI.run(frame)


@settings(CI)
@given(st.dictionaries(st.one_of(st.text(max_size=4), st.integers(), st.binary(max_size=4)), scalars(), max_size=4))
def test_a_decoded_message_with_any_keys_is_refused_cleanly(msg):
    """The parser is public: a caller that skipped `unpack_frame` (keys that are not strings) gets a typed error."""
    try:
        parse_openpi_request({"prompt": "p", **msg})
    except DreamZeroError:
        pass
