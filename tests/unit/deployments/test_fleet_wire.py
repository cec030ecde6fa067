"""The fleet's wire at the server (issue 47, docs/fleet.md), below the doors: the default traffic class of rows that
name none, the per-row reply echo, the doors' per-class chunk latency and deadline misses, the tenant's class in the
config, and the JSON Schema's names and bounds (the parser's). Every door end to end: tests/graph/test_fleet_doors.py.
"""

from __future__ import annotations

import typing

import numpy as np
import pytest

import serve_graph.wire_schema as wire_schema
from deployments.config.sections import TenantQuotaArgs
from deployments.metrics import ServingMetrics
from deployments.requests.generations import GenerationRequest
from deployments.requests.replies import build_response, row_echo
from deployments.requests.rows import RowOptions
from dreamzero.errors import ConfigError
from dreamzero.types import SessionReport
from dreamzero_client.wire.generations import MAX_DEADLINE_MS, TRAFFIC_CLASSES
from serve_graph.config import parse_app_args


def _rows(b: int, **fields) -> RowOptions:
    return RowOptions([f"p{i}" for i in range(b)], [f"s{i}" for i in range(b)], [False] * b, **fields)


def test_rows_that_name_no_class_get_the_tenants_else_realtime_for_one_row_and_batch_for_more():
    assert _rows(1).with_classes().traffic_class == ["realtime"]  # a robot
    assert _rows(3).with_classes().traffic_class == ["batch"] * 3  # a farm posting its environments
    assert _rows(1).with_classes("batch").traffic_class == ["batch"]  # the tenant's class
    assert _rows(3).with_classes("realtime").traffic_class == ["realtime"] * 3
    sent = _rows(2, traffic_class=["realtime", "batch"])
    assert sent.with_classes("batch") is sent  # the request's own field wins


def test_the_echo_is_the_clients_observation_time_else_the_servers_receive_time():
    rows = _rows(2, observed_at=[12.5, None], traffic_class=["realtime", "batch"], received_at=1000.0)
    first, second = row_echo(rows, replied_at=1000.25)
    assert first == {
        "observed_at": 12.5,
        "observed_at_source": "client",
        "server_ms": 250.0,
        "traffic_class": "realtime",
    }
    assert second == {
        "observed_at": 1000.0,
        "observed_at_source": "server",
        "server_ms": 250.0,
        "traffic_class": "batch",
    }
    assert row_echo(_rows(2, received_at=5.0), replied_at=5.0)[0]["traffic_class"] == "batch"  # the default rule


@pytest.mark.parametrize("response_format", ["envelope", "raw"])
def test_every_reply_format_adds_the_echo_inside_each_session_report(response_format):
    request = GenerationRequest({}, _rows(2, observed_at=[1.0, 2.0]), response_format=response_format)
    reports = [SessionReport(f"s{i}", 1, True, "new_session", 1, "inc") for i in range(2)]
    echo = row_echo(request.rows)
    reply = build_response(request, np.zeros((2, 3, 4), np.float32), reports, echo=echo)
    assert [s["session_id"] for s in reply["sessions"]] == ["s0", "s1"]  # the report as before
    assert [s["observed_at"] for s in reply["sessions"]] == [1.0, 2.0]
    assert set(reply) - {"sessions"} == set(build_response(request, np.zeros((2, 3, 4)), reports)) - {"sessions"}


class _Recorder:
    def __init__(self):
        self.calls: list[tuple] = []

    def observe(self, value, tags):
        self.calls.append((value, tags["door"], tags["traffic_class"]))

    def inc(self, value, tags):
        self.calls.append((value, tags["door"], tags["traffic_class"]))


def test_the_doors_count_each_rows_latency_by_class_and_a_miss_only_past_its_deadline():
    metrics = ServingMetrics.__new__(ServingMetrics)  # only the two recorders under test
    metrics.chunk_latency_ms, metrics.deadline_misses = _Recorder(), _Recorder()
    rows = _rows(3, traffic_class=["realtime", "realtime", "batch"], deadline_ms=[50.0, 500.0, None], received_at=0.0)
    metrics.observe_rows("zmq", row_echo(rows, replied_at=0.1), rows.deadline_ms)
    assert metrics.chunk_latency_ms.calls == [(100.0, "zmq", "realtime")] * 2 + [(100.0, "zmq", "batch")]
    assert metrics.deadline_misses.calls == [(1, "zmq", "realtime")]  # 100 ms > 50 ms; 500 ms and no deadline: met


def test_a_tenant_may_set_its_class_and_a_bad_one_is_refused_naming_the_field():
    assert (
        typing.get_args(typing.get_type_hints(TenantQuotaArgs)["traffic_class"])[0] == typing.Literal[TRAFFIC_CLASSES]
    )
    cfg = parse_app_args({"tenants": {"per_tenant": {"farm": {"traffic_class": "batch"}}}})
    assert cfg.tenants.for_tenant("farm").traffic_class == "batch" and cfg.tenants.for_tenant("x").traffic_class is None
    with pytest.raises(ConfigError, match="tenants.per_tenant.farm.traffic_class"):
        parse_app_args({"tenants": {"per_tenant": {"farm": {"traffic_class": "urgent"}}}})


def _property(document: str, model: str, name: str) -> dict:
    return wire_schema.schema_documents()[document]["$defs"][model]["properties"][name]


def _values(node, key: str) -> list:
    """Every value of `key` anywhere in a schema node."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == key] + [x for v in node.values() for x in _values(v, key)]
    return [x for v in node for x in _values(v, key)] if isinstance(node, list) else []


def test_the_schema_names_the_fields_with_the_parsers_classes_and_bounds():
    request, reply = "generations-request.schema.json", "generations-reply.schema.json"
    assert set(_values(_property(request, "GenerationParameters", "deadline_ms"), "maximum")) == {MAX_DEADLINE_MS}
    for document, model in ((request, "GenerationParameters"), (reply, "SessionReportBody")):
        classes = _values(_property(document, model, "traffic_class"), "enum")
        assert classes and all(tuple(c) == TRAFFIC_CLASSES for c in classes)
    for name in ("observed_at", "observed_at_source", "server_ms"):
        assert _property(reply, "SessionReportBody", name)["description"]
    assert _property(request, "GenerationParameters", "observed_at")["description"]
