"""`benchmarks/fleet.py --url`: simulated robots on the client runtime against a live `serve run serve_config.yaml`
(the e2e tier's shared `tiny_server`), through the OpenPI WebSocket and HTTP doors. Every robot's queries carry the
fleet's fields; the figures are there for each fleet, whatever pace this loaded CPU allows. The server's realtime
admission is on: a robot it cannot keep at pace on this CPU is refused (503 `no_capacity`, its reason in the
error), which the benchmark counts as a fleet not at pace."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.support.serve_process import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import fleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("scheme", ["ws", "http"])
def test_fleet_through_a_running_server_s_door(tiny_server, tmp_path, scheme):
    from deployments.admission import REALTIME_IDLE_S

    time.sleep(REALTIME_IDLE_S + 1)  # the earlier tests' robots no longer count: the first robot here is admitted
    out = tmp_path / "fleet.json"
    url = f"{scheme}://127.0.0.1:{tiny_server.port}"
    assert fleet.main(["--url", url, "--robots", "1,2", "--seconds", "3", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert f"a running server at {url}" in record["setting"] and set(record["largest_at_pace"]) == {"batched"}
    rows = record["rows"]
    assert rows and {r["way"] for r in rows} == {"batched"} and rows[0]["robots"] == 1
    first = rows[0]  # one robot: always admitted, answered, its actions executed and their ages measured
    assert not first["errors"] and first["chunks"] >= 1 and first["ticks"] > 0, first
    assert first["age_p99_ms"] >= first["age_p50_ms"] >= 0 and first["rows_per_call"] is None  # calls unseen here
    for r in rows[1:]:  # more robots: answered, or refused by admission with its reason (not at pace, then)
        assert all("cannot keep one more robot at pace" in e for e in r["errors"]), r["errors"]
        assert not r["errors"] or not r["at_pace"]
