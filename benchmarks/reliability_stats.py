"""The pure parts of `benchmarks/reliability.py`: scenario selection, latency summaries, the session-continuity
ledger, RSS drift, Prometheus text and recovery time. No Ray, no server: unit-tested in
tests/unit/benchmarks/test_reliability_script.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

#: every scenario of the script, in the order they run
SCENARIOS = (
    "load", "kill-policy", "kill-preprocess", "kill-ingress", "scale", "disconnect", "soak", "bombs", "slots",
    "zmq-bombs", "zmq-reset", "zmq-rejected", "nan", "evict-count", "evict-bytes",
)  # fmt: skip
#: restart reasons of a session the client had already seen that mean the server no longer held its state (its
#: replica died or was scaled away, it was evicted, or a stale copy was refused); the other reasons (reset_requested,
#: prompt_changed, single_frame, window_full) are the normal course of an episode
LOST_STATE = ("new_session", "evicted", "step_mismatch")


def parse_only(text: str | None) -> list[str]:
    """`--only load,kill-policy` -> the scenarios in run order; None or "" -> all of them."""
    if not text:
        return list(SCENARIOS)
    wanted = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [w for w in wanted if w not in SCENARIOS]
    if unknown:
        raise ValueError(f"--only: unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    return [s for s in SCENARIOS if s in wanted]


#: what a client may retry: 503 (replica replaced, Retry-After), 502/504 from the front door, a refused or reset
#: connection, a bounded wait that ran out, or a WebSocket error frame with status 503
RETRYABLE_ERRORS = frozenset(
    {
        "ServerUnavailableError(503)",
        "ServerUnavailableError(502)",
        "ServerUnavailableError(504)",
        "ServerUnavailableError(connection)",
        "ServerUnavailableError(timeout)",
        "ReplyTimeout",
        "PolicyServerError(503)",
    }
)


def is_retryable(label: str) -> bool:
    """Is an error label (see reliability_clients.error_label) one a client can retry, rather than a bug?"""
    return label in RETRYABLE_ERRORS


def latency_summary(latencies_s: Sequence[float]) -> dict:
    """count, p50 / p99 / max in milliseconds (None when there is nothing to summarise)."""
    if not latencies_s:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ms = np.asarray(latencies_s, dtype=np.float64) * 1000.0
    return {
        "count": int(ms.size),
        "p50_ms": round(float(np.percentile(ms, 50)), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "max_ms": round(float(ms.max()), 1),
    }


@dataclass
class ContinuityLedger:
    """Checks every session report against what the client expected from its previous reply.

    A reply either continues the session (not restarted, step = previous + 1, same incarnation) or says it restarted
    (step 1, a reason). Anything else is silent stale state: the server continued a state the client did not expect
    without flagging it. `forget(session)` is for a client that drops its bookkeeping (a reconnected WebSocket).
    """

    last: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"continued": 0, "restarted": 0, "silent_stale": 0})
    reasons: dict[str, int] = field(default_factory=dict)
    stale_examples: list[dict] = field(default_factory=list)
    lost: int = 0  # restarts of a known session because the server no longer held its state

    def record(self, session: str, report: Mapping) -> str:
        previous = self.last.get(session)
        step, incarnation = report.get("step"), report.get("incarnation")
        if report.get("restarted"):
            verdict = "restarted" if step == 1 and report.get("restart_reason") else "silent_stale"
            reason = str(report.get("restart_reason"))
            self.lost += previous is not None and reason in LOST_STATE
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        elif previous is not None and step == previous[0] + 1 and incarnation == previous[1]:
            verdict = "continued"
        else:
            verdict = "silent_stale"
        if verdict == "silent_stale" and len(self.stale_examples) < 5:
            self.stale_examples.append({"session": session, "previous": previous, "report": dict(report)})
        self.counts[verdict] += 1
        if isinstance(step, int):
            self.last[session] = (step, incarnation if isinstance(incarnation, str) else None)
        return verdict

    def forget(self, session: str) -> None:
        self.last.pop(session, None)


def rss_drift(samples: Mapping[str, Sequence[tuple[float, int]]], warmup_s: float) -> dict[str, dict]:
    """Per process: RSS (MiB) at the first sample after `warmup_s`, at the end, its max, end - start, and the
    least-squares slope of every settled sample in MiB per hour (a leak shows as a steady slope, a transient batch
    as one high sample that the end-to-end growth can miss or overstate).

    `samples` maps a process label to (seconds since the soak began, RSS bytes) pairs. A process with no sample
    after the warm-up is measured from its first sample.
    """
    out = {}
    for label, series in samples.items():
        if not series:
            continue
        settled = [(t, rss) for t, rss in series if t >= warmup_s] or list(series)
        mib = [rss / 2**20 for _, rss in settled]
        out[label] = {
            "start_mib": round(mib[0], 1),
            "end_mib": round(mib[-1], 1),
            "max_mib": round(max(mib), 1),
            "growth_mib": round(mib[-1] - mib[0], 1),
            "slope_mib_per_h": round(rss_slope_mib_per_h([t for t, _ in settled], mib), 2),
            "samples": len(settled),
        }
    return out


def rss_slope_mib_per_h(times_s: Sequence[float], mib: Sequence[float]) -> float:
    """Least-squares slope of `mib` over `times_s`, in MiB per hour (0 with fewer than two distinct times)."""
    t = np.asarray(times_s, dtype=np.float64)
    if t.size < 2 or np.ptp(t) == 0:
        return 0.0
    return float(np.polyfit(t / 3600.0, np.asarray(mib, dtype=np.float64), 1)[0])


def rss_within(drift: Mapping[str, Mapping], bound_mib: float) -> bool:
    """Flat: no process grew by more than `bound_mib` after the warm-up (and at least one was measured)."""
    return bool(drift) and all(d["growth_mib"] <= bound_mib for d in drift.values())


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def prometheus_values(text: str, metric: str, labels: Mapping[str, str] | None = None) -> list[tuple[dict, float]]:
    """Every sample of `metric` in Prometheus text whose labels include `labels`: (labels, value) pairs."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != metric:
            continue
        found = dict(_LABEL.findall(m.group(2) or ""))
        if all(found.get(k) == v for k, v in (labels or {}).items()):
            out.append((found, float(m.group(3))))
    return out


def recovery_time_s(kill_at: float, successes: Mapping[str, Iterable[float]]) -> float | None:
    """Seconds from `kill_at` until every client had a successful reply that ended after it (None: one never did).

    `successes` maps a client to the monotonic end times of its successful calls.
    """
    latest = 0.0
    for times in successes.values():
        after = [t for t in times if t > kill_at]
        if not after:
            return None
        latest = max(latest, min(after) - kill_at)
    return round(latest, 2)
