"""The pure parts of the attack scenarios of benchmarks/reliability.py (issue 45): the ZeroMQ bomb messages reach
the part of the door they are meant to (the token behind the whole tree, within the door's size limit), the
eviction runs' store sizes, the new scenarios' arguments (no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # the script's sibling modules

import reliability
import reliability_session_attacks as session_attacks
import reliability_zmq_attacks as zmq_attacks

from deployments.doors.zmq import read_token


@pytest.mark.parametrize("leaf", [b"\x90", b"\x80"])
def test_zmq_bomb_hides_the_token_behind_the_tree_within_the_size(leaf):
    size = 3 * 1024 * 1024
    body = zmq_attacks.zmq_bomb(leaf, size, "the-key")
    assert 0.9 * size <= len(body) <= size
    message = msgpack.unpackb(body, strict_map_key=False)
    assert list(message) == ["endpoint", "data", "api_token"]  # the token only after the whole tree
    assert message["endpoint"] == "get_action" and message["api_token"] == "the-key"
    assert read_token(body) == "the-key"  # what the door reads before it unpacks anything else
    assert read_token(zmq_attacks.zmq_bomb(leaf, size, None)) is None


def test_eviction_runs_size_the_store_to_sixteen_sessions():
    assert session_attacks.eviction_sessions("count", None)["max_sessions"] == 16
    by_bytes = session_attacks.eviction_sessions("bytes", 1000)
    assert by_bytes["max_bytes"] == 16500 and by_bytes["max_sessions"] > 16  # the bytes bind, not the count


def test_attack_scenarios_and_their_sizes_parse():
    args = reliability.parse_args(["--only", "evict-bytes,zmq-bombs,nan", "--zmq-rejected", "600"])
    assert args.scenarios == ["zmq-bombs", "nan", "evict-bytes"] and args.zmq_rejected == 600
    with pytest.raises(SystemExit):
        reliability.parse_args(["--zmq-reset-s", "0"])
