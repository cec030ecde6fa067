"""The pure parts of benchmarks/reliability.py: argument parsing, summaries, the continuity ledger (no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # the script's sibling modules

import reliability
from reliability_clients import error_label
from reliability_stats import (
    SCENARIOS,
    ContinuityLedger,
    is_retryable,
    latency_summary,
    parse_only,
    prometheus_values,
    recovery_time_s,
    rss_drift,
    rss_slope_mib_per_h,
    rss_within,
)

# 1. Arguments -------------------------------------------------------------------------------------------------------


def test_only_selects_in_run_order_and_defaults_to_all():
    assert parse_only(None) == list(SCENARIOS)
    assert parse_only("soak, load") == ["load", "soak"]
    assert parse_only("kill-policy,,kill-policy") == ["kill-policy"]


def test_only_names_the_unknown_scenario_and_the_choices():
    with pytest.raises(ValueError, match=r"--only: unknown scenario 'kil-policy'; choose from load, kill-policy"):
        parse_only("load,kil-policy")


def test_parse_args_defaults_follow_the_issue():
    args = reliability.parse_args([])
    assert (args.clients, args.requests, args.soak_minutes) == (16, 200, 30.0)
    assert args.scenarios == list(SCENARIOS)


def test_parse_args_scales_down_and_refuses_bad_values(capsys):
    args = reliability.parse_args(["--only", "load", "--clients", "3", "--requests", "5", "--soak-minutes", "0.5"])
    assert (args.scenarios, args.clients, args.requests, args.soak_minutes) == (["load"], 3, 5, 0.5)
    with pytest.raises(SystemExit):
        reliability.parse_args(["--clients", "0"])
    assert "--clients must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        reliability.parse_args(["--timeout-s", "-1"])
    assert "--timeout-s must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        reliability.parse_args(["--only", "nope"])
    assert "unknown scenario 'nope'" in capsys.readouterr().err


# 2. Summary maths --------------------------------------------------------------------------------------------------


def test_latency_summary_in_milliseconds():
    s = latency_summary([i / 1000 for i in range(1, 101)])  # 1 .. 100 ms
    assert s["count"] == 100
    assert s["p50_ms"] == pytest.approx(50.5)
    assert s["p99_ms"] == pytest.approx(99.0)  # 99.01 rounded to 0.1 ms
    assert s["max_ms"] == pytest.approx(100.0)
    assert latency_summary([]) == {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}


def report(step, incarnation, restarted=False, reason=None):
    return {"step": step, "incarnation": incarnation, "restarted": restarted, "restart_reason": reason}


def test_ledger_accepts_continuation_and_flagged_restarts():
    ledger = ContinuityLedger()
    assert ledger.record("a", report(1, "x", True, "new_session")) == "restarted"
    assert ledger.record("a", report(2, "x")) == "continued"
    assert ledger.record("a", report(1, "y", True, "step_mismatch")) == "restarted"
    assert ledger.record("a", report(2, "y")) == "continued"
    assert ledger.record("a", report(1, "z", True, "window_full")) == "restarted"
    assert ledger.counts == {"continued": 2, "restarted": 3, "silent_stale": 0}
    assert ledger.lost == 1  # the first new_session and window_full are routine


@pytest.mark.parametrize(
    "second",
    [
        report(5, "x"),  # skipped steps: another state continued
        report(2, "other"),  # right step, different incarnation: a stale copy elsewhere
        report(3, "x", True, None),  # "restarted" without a reason and past step 1
    ],
)
def test_ledger_flags_silent_stale_state(second):
    ledger = ContinuityLedger()
    ledger.record("a", report(1, "x", True, "new_session"))
    assert ledger.record("a", second) == "silent_stale"
    assert ledger.counts["silent_stale"] == 1 and ledger.stale_examples[0]["session"] == "a"


def test_ledger_unknown_session_continuing_is_stale_until_forgotten_and_restarted():
    ledger = ContinuityLedger()
    assert ledger.record("b", report(7, "z")) == "silent_stale"  # the client never saw this state
    ledger.forget("b")
    assert ledger.record("b", report(1, "w", True, "new_session")) == "restarted"
    assert ledger.record("b", report(1, "v", True, "new_session")) == "restarted"  # moved to a replica without it
    assert ledger.lost == 1


def test_rss_drift_measures_after_warmup_and_bound():
    mib = 2**20
    samples = {"Policy#a": [(0, 100 * mib), (30, 200 * mib), (60, 210 * mib), (90, 205 * mib)], "Ingress#b": []}
    drift = rss_drift(samples, warmup_s=30)
    assert drift == {
        "Policy#a": {
            "start_mib": 200.0,
            "end_mib": 205.0,
            "max_mib": 210.0,
            "growth_mib": 5.0,
            "slope_mib_per_h": 300.0,  # least squares over (30 s, 200), (60 s, 210), (90 s, 205): 5 MiB a minute
            "samples": 3,
        }
    }
    assert rss_within(drift, 5.0) and not rss_within(drift, 4.9)
    assert not rss_within({}, 100.0)  # nothing measured is not "flat"
    assert rss_drift({"p": [(0, mib), (1, 3 * mib)]}, warmup_s=10)["p"]["growth_mib"] == 2.0  # short: all samples


def test_rss_slope_is_the_least_squares_rate_per_hour():
    hours = [0.0, 0.25, 0.5, 0.75]
    assert rss_slope_mib_per_h([h * 3600 for h in hours], [100 + 8 * h for h in hours]) == pytest.approx(8.0)
    assert rss_slope_mib_per_h([10.0], [5.0]) == 0.0 and rss_slope_mib_per_h([3.0, 3.0], [1.0, 9.0]) == 0.0


def test_prometheus_values_filter_by_labels():
    text = "\n".join(
        [
            "# HELP ray_dreamzero_live_sessions Sessions held",
            'ray_dreamzero_live_sessions{application="dzrel",replica="r1"} 3.0',
            'ray_dreamzero_live_sessions{application="dzrel",replica="r2"} 4.0',
            'ray_dreamzero_live_sessions{application="other",replica="r3"} 9.0',
            'ray_dreamzero_live_sessions_total{application="dzrel"} 100.0',
        ]
    )
    values = prometheus_values(text, "ray_dreamzero_live_sessions", {"application": "dzrel"})
    assert [(lab["replica"], v) for lab, v in values] == [("r1", 3.0), ("r2", 4.0)]
    assert prometheus_values(text, "missing") == []


def test_recovery_time_is_the_slowest_clients_first_success_after_the_kill():
    assert recovery_time_s(10.0, {"a": [9.0, 10.5, 11.0], "b": [8.0, 13.25]}) == 3.25
    assert recovery_time_s(10.0, {"a": [11.0], "b": [9.0]}) is None  # b was never served again


def test_error_labels_and_which_are_retryable():
    from dreamzero_client.errors import BadRequestError, PolicyServerError, ServerUnavailableError

    assert error_label(ServerUnavailableError("x", attempts=1, status=503)) == "ServerUnavailableError(503)"
    assert error_label(ServerUnavailableError("x", attempts=1)) == "ServerUnavailableError(connection)"
    timed_out = ServerUnavailableError("POST ... failed after 1 attempts; last: ReadTimeout: timed out", attempts=1)
    assert error_label(timed_out) == "ServerUnavailableError(timeout)"
    assert is_retryable("ServerUnavailableError(timeout)")
    assert error_label(PolicyServerError("x", status=503, code="no_capacity")) == "PolicyServerError(503)"
    assert is_retryable("ServerUnavailableError(503)") and is_retryable("ServerUnavailableError(connection)")
    assert is_retryable("PolicyServerError(503)")
    label = error_label(BadRequestError("bad", 422, "invalid_observation", "state"))
    assert label == "BadRequestError(422)" and not is_retryable(label)
    assert not is_retryable("ServerUnavailableError(500)")  # an internal error is a bug, not a retryable condition


def test_affected_sessions_are_judged_on_their_first_reply_elsewhere():
    from reliability_clients import CallRecord, Worker

    def worker(name, records):
        w = Worker(name, "normalised", "http://127.0.0.1:1", 10, 0.0)
        w.records = records
        return w

    ok = lambda t, replica, verdict="continued": CallRecord(t, t + 0.1, True, verdict=verdict, replica=replica)  # noqa: E731
    workers = [
        worker("moved", [ok(1, "dead"), ok(5, "live", "restarted"), ok(6, "live")]),
        worker("silent", [ok(1, "dead"), ok(5, "live", "continued")]),
        worker("elsewhere", [ok(1, "live"), ok(5, "live")]),
    ]
    out = reliability.affected_http_sessions(workers, "dead", kill_at=3.0)
    assert out == {"affected": 2, "flagged_restarted": 1, "not_flagged": ["silent"]}
