"""The robot client's fleet arguments (docs/fleet.md): `traffic_class`, `deadline_ms` and `observed_at` reach the body
or message each transport sends only when given, so a server that does not know them sees today's message. The
transports' sending is replaced by a recorder: no server (the doors' side: tests/graph/test_fleet_doors.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero_client.http_client import ActionClient
from dreamzero_client.openpi_client import OpenPIClient
from dreamzero_client.wire import codec, generations
from dreamzero_client.zmq_client import ZmqPolicyClient

FIELDS = {"traffic_class": "realtime", "deadline_ms": 400.0, "observed_at": 1234.5}
PER_ROW = {"traffic_class": ["realtime", "batch"], "deadline_ms": [400.0, None], "observed_at": [1.0, 2.0]}


def _body(**kwargs) -> dict:
    return generations.build_request_body({"state": np.zeros((2, 8))}, ["p", "p"], ["a", "b"], **kwargs)


def test_the_body_carries_the_fields_only_when_given():
    plain = _body()
    assert not set(FIELDS) & set(plain["parameters"])  # today's body
    assert {k: _body(**PER_ROW)["parameters"][k] for k in PER_ROW} == PER_ROW
    one = _body(traffic_class="batch")["parameters"]
    assert one["traffic_class"] == "batch" and "deadline_ms" not in one and "observed_at" not in one


class _Sent(Exception):
    """Raised by the recorders once the message is built: what a transport would send, and no network."""


def test_the_http_client_sends_them_in_parameters(monkeypatch):
    pytest.importorskip("httpx")
    client = ActionClient("http://127.0.0.1:9", max_retries=0)
    sent = []

    def record(method, path, content=None, headers=None, timeout_s=None):
        sent.append(codec.decode_body(content, headers["Content-Type"])[0])
        raise _Sent

    monkeypatch.setattr(client, "_request", record)
    for kwargs in ({}, FIELDS):
        with pytest.raises(_Sent):
            client.generate({"state": np.zeros((1, 8))}, "p", "a", **kwargs)
    plain, fleet = (body["parameters"] for body in sent)
    assert not set(FIELDS) & set(plain) and {k: fleet[k] for k in FIELDS} == FIELDS
    client.close()


def _recording(cls, reply):
    """A transport object without its connection: its one send method records the message and returns `reply`."""
    client, sent = cls.__new__(cls), []
    client.resume = False

    def record(*message):
        sent.append(message[-1])
        return reply

    client._call = client.call = record
    return client, sent


def test_the_openpi_client_adds_them_to_the_message():
    client, sent = _recording(OpenPIClient, np.zeros((4, 8), np.float32))
    obs = {"observation/joint_position": np.zeros(7), "prompt": "p"}
    client.infer(obs)
    client.infer(obs, **FIELDS)
    assert not set(FIELDS) & set(sent[0]) and {k: sent[1][k] for k in FIELDS} == FIELDS
    assert "traffic_class" not in obs  # the caller's dict is left as it was


def test_the_zmq_client_adds_them_to_options():
    client, sent = _recording(ZmqPolicyClient, ({"joint_position": np.zeros((1, 4, 7))}, {"sessions": []}))
    client.get_action({"state.joint_position": np.zeros((1, 1, 7))}, {"session_ids": ["a"]})
    client.get_action({"state.joint_position": np.zeros((1, 1, 7))}, None, **PER_ROW)
    assert sent[0]["options"] == {"session_ids": ["a"]}  # today's options
    assert sent[1]["options"] == PER_ROW
