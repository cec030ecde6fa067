"""DROID evaluation against a live `serve run serve_config.yaml` (embedded tiny model, CPU) over the OpenPI WebSocket.

1. a short run (scene 1, 1 episode, 2 chunks) produces the video, per-step JSON, summary and report;
2. a second run with the server gone halfway (a relay in front of it cut: open connections closed, new ones refused,
   as a stopped server looks to the client) records the failure with its reason and finishes.
The server is the e2e tier's shared `tiny_server` (tests/e2e/conftest.py).
"""

from __future__ import annotations

import json

import pytest

from dreamzero_droid.links import OpenPILink
from dreamzero_droid.policy import DroidPolicy
from eval.cli import main
from eval.mujoco_droid import MujocoDroidEnv
from eval.runner import EvalConfig, run_evaluation
from tests.support.tcp_relay import TcpRelay

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def live_server(tiny_server):
    return tiny_server


def test_short_run_against_the_live_server(live_server, tmp_path):
    code = main(
        [
            "--scenes",
            "1",
            "--max-steps",
            "16",
            "--render",
            "fast",
            "--port",
            str(live_server.port),
            "--timeout-s",
            "120",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert code == 0, live_server.log_tail()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed_episodes"] == 0, summary["failures"]
    assert summary["server_calls"] == 2 and summary["latency_ms"]["count"] == 2
    record = json.loads((tmp_path / "episodes" / "scene1_ep000.json").read_text())
    first, second = record["server_sessions"]  # the server's own continuity report for our session
    assert first["restart_reason"] == "new_session" and not second["restarted"] and second["step"] == 2
    assert len(record["steps"]) == 16 and all(len(s["action"]) == 8 for s in record["steps"])
    for path in ("videos/scene1_ep000.mp4", "report.html", "summary.md", "plots/latency_hist.png"):
        assert (tmp_path / path).stat().st_size > 0, path


class _StopServerAfter:
    """Wraps a link and cuts the relay to the live server right after the n-th successful call."""

    def __init__(self, link, n, relay: TcpRelay):
        self.link, self.n, self.relay, self.calls = link, n, relay, 0
        self.name = link.name

    def send(self, query):
        reply = self.link.send(query)
        self.calls += 1
        if self.calls == self.n:
            self.relay.cut()
        return reply

    def reset(self, session_id):
        self.link.reset(session_id)

    def close(self):
        self.link.close()


def test_server_stopped_halfway_is_recorded_and_the_run_finishes(live_server, tmp_path):
    with TcpRelay(live_server.port) as relay:
        _run_until_the_server_is_gone(relay, tmp_path)


def _run_until_the_server_is_gone(relay: TcpRelay, tmp_path) -> None:
    ws = OpenPILink(f"ws://127.0.0.1:{relay.port}", timeout_s=30, max_reconnects=0)
    link = DroidPolicy(_StopServerAfter(ws, 2, relay))
    try:
        config = EvalConfig(out_dir=tmp_path, episodes_per_scene=2, max_steps=24, record_video=False)
        summary = run_evaluation(lambda s: MujocoDroidEnv(s, image_size=(90, 160), render_quality="fast"), link, config)
    finally:
        link.close()
    assert summary["episodes"] == 2 and summary["failed_episodes"] == 2
    first, second = summary["failures"]
    assert first["step"] == 16 and first["reason"] in ("server_unreachable", "timeout"), first
    assert second["step"] == 0 and second["reason"] == "server_unreachable", second
    assert summary["server_calls"] == 2
