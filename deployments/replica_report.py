"""What a Policy replica tells the outside: health, routing statistics, its gauges, its session audit and its info.

- health: `unservable()` says why the replica cannot serve (no pipeline, a model call stuck past `STUCK_CALL_S`, a
  broken CFG-parallel pair); the replica's `ready` (the ingress's /health) and `check_health` (Serve) raise with it.
- routing statistics: the routing keys of the sessions this replica holds (`HeldKeys`), for the session router.
- gauges: live sessions and their bytes, evictions, per-tenant live sessions, per-call rows (deployments.metrics).
- traffic per class (docs/fleet.md "Scheduling"): queue time, rows per call, deadline misses, as metrics and in
  `stats()`.
- audit: session starts, resets, ends and evictions, one line each (deployments.tenants `audit`).
- info: what `GET /v1/models` and the doors' handshakes say about this replica (deployments.model_info).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from deployments.routing import STATS_KEYS, STATS_SESSIONS, HeldKeys
from deployments.tenants import audit, audit_reports

if TYPE_CHECKING:
    from deployments.engine import Engine, ModelThread
    from dreamzero.types import ModelBatch

CLASSES = ("realtime", "batch")

#: a model call running longer than this means a hung device or a deadlock: the replica reports itself unhealthy and
#: Serve replaces it. Far above any chunk (a 14B batch of 8 rows takes seconds; a CPU warm-up is done at start).
STUCK_CALL_S = 600.0


def eviction_audit(replica: str):
    """The session store's `on_evict` for this replica: one audit line per eviction (called under the store's lock)."""
    return lambda session_id, cause: audit("evict", session_id, replica, f"cause={cause}")


class ReplicaReport:
    """The replica's reports, read from its engine and model thread; counters of what was reported already."""

    def __init__(self, replica: str, engine: Engine, model_thread: ModelThread, metrics: Any):
        self.replica, self.engine, self.model_thread, self.metrics = replica, engine, model_thread, metrics
        self.routing_keys = HeldKeys()  # routing key -> session ids of the requests in flight
        self._evictions_seen = 0
        self._tenants_seen: set[str] = set()  # tenants with a live-session gauge (set to 0 when they leave)
        # per class: requests taken, their queue ms in all, rows run, rows ready after their deadline
        self._traffic = {c: {"requests": 0, "queue_ms": 0.0, "rows": 0, "deadline_misses": 0} for c in CLASSES}

    # --- after model calls and session control ------------------------------------------------------------------
    def calls_done(self, calls: list[tuple[int, list, float, int]]) -> None:
        """(rows, session reports, ms, realtime rows) per model call of a batch: the call metrics, the audit lines,
        the gauges."""
        for rows, sessions, _, realtime in calls:
            self.metrics.batch_rows.observe(rows)
            for cls, n in (("realtime", realtime), ("batch", rows - realtime)):
                if n:
                    self.metrics.class_rows.observe(n, tags={"traffic_class": cls})
                    self._traffic[cls]["rows"] += n
            self.metrics.observe_sessions(sessions)
            audit_reports(sessions, self.replica)
        self.update_gauges()

    def taken(self, cls: str, queue_ms: float) -> None:
        """A request of class `cls` was taken into a model call after `queue_ms` in the batcher's queue."""
        self.metrics.class_queue_ms.observe(queue_ms, tags={"traffic_class": cls})
        self._traffic[cls]["requests"] += 1
        self._traffic[cls]["queue_ms"] += queue_ms

    def deadlines_checked(self, batch: ModelBatch, now: float) -> None:
        """A request's result is ready at `now` (wall clock): each row past its stated deadline is a miss."""
        if batch.deadline_at is None:
            return
        classes = batch.traffic_class or ["realtime"] * len(batch)
        for cls, deadline in zip(classes, batch.deadline_at):
            if deadline is not None and now > deadline:
                cls = cls if cls in self._traffic else "realtime"
                self.metrics.policy_deadline_misses.inc(1, tags={"traffic_class": cls})
                self._traffic[cls]["deadline_misses"] += 1

    def traffic(self) -> dict:
        """Per class: requests, rows, mean queue ms, deadline misses, since the replica started."""
        out = {}
        for cls, t in self._traffic.items():
            mean = t["queue_ms"] / t["requests"] if t["requests"] else 0.0
            out[cls] = {
                "requests": t["requests"],
                "rows": t["rows"],
                "queue_ms_mean": round(mean, 3),
                "deadline_misses": t["deadline_misses"],
            }
        return out

    def sessions_ended(self, session_ids: list[str]) -> None:
        for sid in session_ids:
            audit("end", sid, self.replica)
        self.update_gauges()

    def sessions_reset(self, session_ids: list[str]) -> None:
        for sid in session_ids:
            audit("reset", sid, self.replica, "asked")

    def update_gauges(self) -> None:
        stats = self.engine.pipeline.stats()  # SessionStore.stats(): live, bytes, reserved_bytes, max_bytes, ...
        self.metrics.live_sessions.set(float(stats["live"]))
        self.metrics.observe_session_bytes(stats.get("reserved_bytes"), stats["bytes"], stats.get("max_bytes"))
        if stats["evictions"] > self._evictions_seen:
            self.metrics.evictions.inc(stats["evictions"] - self._evictions_seen)
            self._evictions_seen = stats["evictions"]
        counts = self.engine.store.group_counts()
        for tenant in self._tenants_seen | set(counts):
            self.metrics.tenant_live_sessions.set(float(counts.get(tenant, 0)), tags={"tenant": tenant})
        self._tenants_seen = set(counts)

    # --- asked from outside -------------------------------------------------------------------------------------
    def routing_stats(self) -> dict:
        """The routing keys of the sessions this replica holds; only reads the store's index (membership tests,
        atomic under the GIL), so a long model call never delays it."""
        keys, sessions = self.routing_keys.live(self.engine.store)
        return {STATS_KEYS: keys, STATS_SESSIONS: sessions}

    def stats(self) -> dict:
        """This replica's session store: live sessions, bytes held and reserved, budget, evictions, restarts."""
        return {"replica": self.replica, **self.engine.stats()}

    def info(self, batching: bool) -> dict:
        pipeline = self.engine.pipeline
        loop_cfg = pipeline.config  # PipelineConfig: the inference-loop knobs in effect
        model_cfg = getattr(getattr(pipeline, "model", None), "config", None)  # DreamZeroConfig when known
        dit_cfg = getattr(model_cfg, "dit", None)
        return {
            "replica": self.replica,
            "config_name": getattr(model_cfg, "name", "custom"),
            "embodiment_tag": getattr(model_cfg, "embodiment_tag", None),
            "action_horizon": int(pipeline.action_horizon),
            "max_action_dim": int(pipeline.max_action_dim),
            "max_state_dim": int(getattr(dit_cfg, "max_state_dim", 64)),
            "default_seed": int(loop_cfg.default_seed),
            "num_inference_steps": int(loop_cfg.num_inference_steps),
            "batching": batching,
            "max_batch_rows": int(self.engine.max_batch_rows),
            "memory": self.engine.memory,
            "cfg_parallel": self.engine.cfg_parallel,
        }

    def unservable(self) -> str | None:
        """Why this replica cannot serve, or None."""
        if getattr(self.engine, "pipeline", None) is None:
            return "the model pipeline is not loaded"
        since = self.model_thread.busy_since
        if since is not None and time.monotonic() - since > STUCK_CALL_S:
            return f"a model call has been running for {time.monotonic() - since:.0f} s (limit {STUCK_CALL_S:g} s)"
        return self.engine.health()
