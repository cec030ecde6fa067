"""`benchmarks/fleet.py --url`: simulated robots on the client runtime against a live `serve run serve_config.yaml`
(the e2e tier's shared `tiny_server`), through the OpenPI WebSocket and HTTP doors. Every robot's queries carry the
fleet's fields; the figures are there for each fleet, whatever pace this loaded CPU allows."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.serve_process import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import fleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("scheme", ["ws", "http"])
def test_fleet_through_a_running_server_s_door(tiny_server, tmp_path, scheme):
    out = tmp_path / "fleet.json"
    url = f"{scheme}://127.0.0.1:{tiny_server.port}"
    assert fleet.main(["--url", url, "--robots", "1,2", "--seconds", "3", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert f"a running server at {url}" in record["setting"] and set(record["largest_at_pace"]) == {"batched"}
    rows = record["rows"]
    assert rows and {r["way"] for r in rows} == {"batched"} and rows[0]["robots"] == 1
    for r in rows:  # no reference way against a server; every robot was answered, chunks executed, ages measured
        assert not r["errors"], r["errors"]
        assert r["chunks"] >= r["robots"] and r["ticks"] > 0 and r["age_p99_ms"] >= r["age_p50_ms"] >= 0, r
        assert r["rows_per_call"] is None  # the server's calls are not seen from outside
