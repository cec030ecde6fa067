"""Serving metrics through Ray Serve's metrics API (exported at Ray's Prometheus endpoint, prefixed `ray_`).

Inside a replica Ray adds `deployment`, `replica` and `application` tags. Metric objects are created once per
process (Ray registers them by name) and shared by every deployment class living there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

from ray.serve.metrics import Counter, Gauge, Histogram

from dreamzero.types import SessionReport

#: milliseconds; from a tiny CPU model's millisecond stages up to a 14B chunk of seconds
LATENCY_BOUNDARIES_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]
BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128]


class ServingMetrics:
    """Typed recorders for the numbers an operator watches."""

    def __init__(self) -> None:
        self.requests = Counter(
            "dreamzero_requests_total",
            description="Requests answered, by route, status code and request form.",
            tag_keys=("route", "status", "form"),
        )
        self.stage_latency_ms = Histogram(
            "dreamzero_stage_latency_ms",
            description="Latency per stage (decode, preprocess, policy, postprocess, encode, total, and model stages).",
            boundaries=LATENCY_BOUNDARIES_MS,
            tag_keys=("stage",),
        )
        self.live_sessions = Gauge("dreamzero_live_sessions", description="Sessions held by this policy replica.")
        self.session_restarts = Counter(
            "dreamzero_session_restarts_total",
            description="Session (re)starts reported to clients, by reason.",
            tag_keys=("reason",),
        )
        self.evictions = Counter(
            "dreamzero_session_evictions_total", description="Sessions evicted (LRU/TTL) by this policy replica."
        )
        self.batch_rows = Histogram(
            "dreamzero_batch_rows",
            description="Session rows per model call after dynamic batching.",
            boundaries=BATCH_BOUNDARIES,
        )
        self.batch_requests = Histogram(
            "dreamzero_batch_requests",
            description="Requests merged into one dynamic batch.",
            boundaries=BATCH_BOUNDARIES,
        )
        self.raw_stage_runs = Counter(
            "dreamzero_raw_stage_runs_total",
            description="Raw-form preprocess / postprocess runs, by where they ran: `ingress` (the front door's "
            "process) or `replicas` (their own deployment); see preprocess.placement.",
            tag_keys=("stage", "where"),
        )
        self.ws_connections = Gauge("dreamzero_ws_connections", description="Open OpenPI WebSocket connections.")
        self.session_bytes = Gauge(
            "dreamzero_session_bytes",
            description="Session memory of this policy replica: `reserved` (peak footprints admitted), `held` (what "
            "the sessions' tensors hold now), `budget` (sessions.max_bytes; absent without a limit).",
            tag_keys=("kind",),
        )
        self.admissions_refused = Counter(
            "dreamzero_admissions_refused_total",
            description="Requests refused with 503 because their sessions did not fit the session byte budget.",
        )
        # per tenant (deployments.tenants); a label holds a tenant name, never a key or a session id
        self.tenant_requests = Counter(
            "dreamzero_tenant_requests_total",
            description="Requests answered per tenant, by front door (http, openpi_ws, zmq) and status code "
            "(`unauthenticated`: no valid key).",
            tag_keys=("tenant", "door", "status"),
        )
        self.tenant_errors = Counter(
            "dreamzero_tenant_errors_total",
            description="Error replies per tenant, by front door and error code (quota_exceeded, invalid_observation, "
            "no_capacity, ...).",
            tag_keys=("tenant", "door", "code"),
        )
        self.tenant_bytes = Counter(
            "dreamzero_tenant_bytes_total",
            description="Bytes of requests received (`in`) and replies sent (`out`) per tenant, by front door.",
            tag_keys=("tenant", "door", "direction"),
        )
        self.tenant_live_sessions = Gauge(
            "dreamzero_tenant_live_sessions",
            description="Sessions held by this policy replica, per tenant.",
            tag_keys=("tenant",),
        )
        self.tenant_quota_refusals = Counter(
            "dreamzero_tenant_quota_refusals_total",
            description="Requests refused with 429 per tenant, by quota (requests_per_s, max_rows_per_request, "
            "max_sessions_per_replica, max_sessions).",
            tag_keys=("tenant", "quota"),
        )
        # the fleet, at the doors (issue 47, docs/fleet.md): per traffic class, what a row's client waited
        self.chunk_latency_ms = Histogram(
            "dreamzero_chunk_latency_ms",
            description="Per row: the door received the request -> the door replied (the reply's server_ms), by "
            "front door and traffic class.",
            boundaries=LATENCY_BOUNDARIES_MS,
            tag_keys=("door", "traffic_class"),
        )
        self.deadline_misses = Counter(
            "dreamzero_deadline_misses_total",
            description="Rows answered after the deadline_ms they stated (their client ran out of actions), by front "
            "door and traffic class.",
            tag_keys=("door", "traffic_class"),
        )
        # the fleet, at the Policy replica (docs/fleet.md "Scheduling"): how the batcher served each class
        self.class_queue_ms = Histogram(
            "dreamzero_policy_queue_ms",
            description="Per request at the Policy: submitted to the batcher -> taken into a model call, by traffic "
            "class.",
            boundaries=LATENCY_BOUNDARIES_MS,
            tag_keys=("traffic_class",),
        )
        self.class_rows = Histogram(
            "dreamzero_policy_class_rows",
            description="Session rows of one traffic class in one model call (a call holding none is not counted).",
            boundaries=BATCH_BOUNDARIES,
            tag_keys=("traffic_class",),
        )
        self.policy_deadline_misses = Counter(
            "dreamzero_policy_deadline_misses_total",
            description="Rows whose result was ready at the Policy after their deadline (received_at + deadline_ms), "
            "by traffic class.",
            tag_keys=("traffic_class",),
        )
        self.realtime_refusals = Counter(
            "dreamzero_realtime_refusals_total",
            description="New realtime sessions refused with 503 because the replica could not keep them and the "
            "admitted ones at pace (batching.realtime_admission).",
        )

    # convenience recorders ------------------------------------------------------------------------------------
    def observe_stages(self, timings_ms: dict[str, float]) -> None:
        for stage, ms in timings_ms.items():
            self.stage_latency_ms.observe(float(ms), tags={"stage": stage})

    def observe_session_bytes(self, reserved, held, budget) -> None:
        for kind, value in (("reserved", reserved), ("held", held), ("budget", budget)):
            if isinstance(value, (int, float)):
                self.session_bytes.set(float(value), tags={"kind": kind})

    def count_tenant(self, tenant: str, door: str, status: int, code: str | None = None) -> None:
        """One answered request of `tenant` at `door`; an error reply also counts under its code."""
        self.tenant_requests.inc(1, tags={"tenant": tenant, "door": door, "status": str(status)})
        if code is not None:
            self.tenant_errors.inc(1, tags={"tenant": tenant, "door": door, "code": code})

    def count_bytes(self, tenant: str, door: str, received: int, sent: int) -> None:
        """The bytes of one request of `tenant` at `door` and of its reply."""
        for direction, n in (("in", received), ("out", sent)):
            if n:
                self.tenant_bytes.inc(int(n), tags={"tenant": tenant, "door": door, "direction": direction})

    def observe_rows(self, door: str, echo: Sequence[Mapping], deadlines_ms: Sequence[float | None] | None) -> None:
        """A reply's rows at `door`: each row's chunk latency under its class, and a miss when it stated a
        deadline the reply came after (`echo`: deployments.requests.replies.row_echo)."""
        for i, row in enumerate(echo):
            tags = {"door": door, "traffic_class": row["traffic_class"]}
            self.chunk_latency_ms.observe(float(row["server_ms"]), tags=tags)
            deadline = None if deadlines_ms is None else deadlines_ms[i]
            if deadline is not None and row["server_ms"] > deadline:
                self.deadline_misses.inc(1, tags=tags)

    def observe_sessions(self, reports: Iterable[SessionReport]) -> None:
        for report in reports:
            if report.restarted:
                self.session_restarts.inc(1, tags={"reason": report.restart_reason or "unknown"})


_lock = threading.Lock()
_instance: ServingMetrics | None = None


def serving_metrics() -> ServingMetrics:
    """The process-wide metrics (Ray refuses two metrics with one name and different definitions)."""
    global _instance
    with _lock:
        if _instance is None:
            _instance = ServingMetrics()
        return _instance
