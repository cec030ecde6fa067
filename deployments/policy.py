"""Policy deployment: the only holder of the model and of per-session state (one instance per replica).

The replica is a composition of parts, each its own class: the engine (`deployments.engine`: the model pipeline, the
CFG-parallel pair or the recorded-actions replay, as `policy` asks; it builds the session store), its admission
(`deployments.admission`: row limits, state range, tenant quotas, memory), the continuous batcher feeding the one
model thread, and its reports (`deployments.replica_report`: health, routing statistics, gauges, audit). This class
wires them and keeps the surface Serve and the handles call (`generate`, session control, `stats`, `info`, `ready`,
`check_health`, `record_routing_stats`, `reconfigure`).

Concurrent requests are merged by a continuous batcher (`deployments.batcher`: a batch forms when the model is free,
waiting at most `batch_wait_timeout_s` for the clients of the previous batch) into as few model calls as possible.
Requests are only merged when their arrays stack and when they share no session (`deployments.batch_merge`). Inside a
model call every row shares the same forwards, whatever its session's frame position (restarting rows add one
prefill). A failing group fails only its own requests.

Memory is admitted per request before requests are merged (dreamzero.sessions, docs/model.md "Memory and admission"):
a request whose sessions do not fit the byte budget gets CapacityError (503 + Retry-After) alone; batches are bounded
in session rows (`max_batch_rows`) and a request larger than a batch or than `rows_per_request` gets 413.

Traffic classes (docs/fleet.md "Scheduling"): the batcher fills each call with realtime rows (robots) first, earliest
deadline first, then batch rows (evaluation farms), with a floor for batch; admission refuses a new realtime session
the replica cannot keep at pace by its measured cost per row (`batching.traffic_classes`, `batch_floor_calls`,
`realtime_admission`). Per class, the replica counts queue time, rows per call and deadline misses.

Tenants (deployments.tenants): session ids arrive scoped by tenant; the store evicts within a tenant over its share
first, a request may carry its tenant's session quotas (`SessionLimits`, checked at admission: 429 beyond them; the
total across replicas through the tenant ledger), and session starts, resets, evictions and ends are audited.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np
from ray import serve

from deployments.admission import Admission, earliest_deadline, realtime_rows, traffic_class
from deployments.audit import configure_audit_log, one_line_refusals
from deployments.batch_merge import merge_batches, plan_groups, split_result
from deployments.batch_slices import join_results, slices
from deployments.batcher import ContinuousBatcher
from deployments.config.settings import PolicySettings
from deployments.engine import Engine, ModelThread, StoreOptions, load_engine
from deployments.metrics import serving_metrics
from deployments.replica_report import ReplicaReport, eviction_audit
from deployments.tenants import SessionLimits, tenant_of
from dreamzero.errors import ConfigError, InvalidObservation, InvalidRequest, NotReady
from dreamzero.types import ChunkResult, ModelBatch

log = logging.getLogger("dreamzero.serve.policy")


@dataclass
class PolicyOutput:
    """What one request gets back: its rows of the chunk plus who computed them."""

    result: ChunkResult
    replica: str
    batch_requests: int = 1  # requests merged into the model call that served this one


@dataclass
class _Outcome:
    # a batch function can only fail a whole batch; wrapping lets one bad group fail alone.
    output: PolicyOutput | None = None
    error: BaseException | None = None


def video_recorder(settings: PolicySettings):
    """The replica's `VideoRecorder` when `video.save_dir` is set, else None."""
    v = settings.video
    if v.save_dir is None:
        return None
    try:
        import imageio_ffmpeg  # noqa: F401 - the MP4 encoder the recorder runs
    except ImportError:
        raise ConfigError(
            "video.save_dir needs imageio-ffmpeg on the policy replicas: pip install 'dreamzero-serve[video]'"
        ) from None
    from dreamzero.video_recorder import VideoRecorder

    return VideoRecorder(v.save_dir, v.every_n_chunks, v.max_bytes, v.with_input, v.fps, v.idle_s)


def run_recorded(engine: Engine, recorder, batch: ModelBatch, return_latents: bool) -> ChunkResult:
    """`video.save_dir`: every row's frames are decoded for the recorder; the reply keeps only those asked for."""
    asked = batch.return_video
    batch.return_video = [True] * len(batch)
    try:
        result = engine.generate(batch, return_latents)
    finally:
        batch.return_video = asked
    for i, (report, frames) in enumerate(zip(result.sessions, result.video or ())):
        recorder.add(report.session_id, report.incarnation, frames, batch.images[i])
    keep = asked or [False] * len(batch)
    video = [v if k else None for v, k in zip(result.video or (), keep)]
    result.video = video if any(keep) else None
    return result


def starts_session(store, batch: ModelBatch) -> bool:
    """Does this request start (or reset) a session? Such requests wait for company (deployments.batcher)."""
    if batch.reset_mask and any(batch.reset_mask):
        return True
    return any(sid not in store for sid in batch.session_ids)


def _non_finite_actions(result: ChunkResult) -> InvalidObservation | None:
    """The error for a request whose actions hold NaN or inf (nothing of it is sent), else None."""
    actions = np.asarray(result.actions)
    if np.isfinite(actions).all():
        return None
    rows = sorted({int(r) for r in np.argwhere(~np.isfinite(actions))[:, 0]})
    return InvalidObservation(
        f"the model's actions for row(s) {rows[:8]} are NaN or infinite and were not sent; an input far outside the "
        "training range (state, images) causes this: check the observation",
        field="actions",
    )


def _replica_name() -> str | None:
    """This replica's id, or None outside a Serve replica (in-process use, local testing mode)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - Serve raises different errors outside a replica, by version and mode
        return None


def _ledger_name() -> str:
    """The tenant ledger actor's name: one per application (its Policy replicas share it)."""
    try:
        app = serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - outside a replica
        app = "local"
    return f"dreamzero-tenant-ledger-{app}"


class PolicyDeployment:
    """A Policy replica: its engine (the model, the CFG pair or the replay), its admission, its batcher on one model
    thread, and its reports; serves chunks for batches of sessions."""

    def __init__(self, settings: PolicySettings | None = None):
        t0 = time.perf_counter()
        s = self.settings = settings or PolicySettings()
        replica = _replica_name()  # None outside a Serve replica
        self.replica = replica or f"local-{uuid.uuid4().hex[:8]}"
        # the session store is built by the engine with the replica's tenants and its eviction audit
        options = StoreOptions(group_of=tenant_of, on_evict=eviction_audit(self.replica), retry_after_s=s.retry_after_s)
        self.engine = load_engine(s, options)
        self.pipeline = self.engine.pipeline  # the engine's session holder, for in-process callers and tests
        # the loop knobs of `args`: a live `user_config` applies over them (deployments.live_tuning)
        self.start_loop = getattr(self.pipeline, "config", None)
        if replica is not None:  # in a Serve replica: the audit log is written, refusals log one line each
            configure_audit_log()
            one_line_refusals()
        self.return_latents = s.return_latents
        self.recorder = video_recorder(s) if s.replay is None else None  # `video.save_dir`; None: off
        self.metrics = serving_metrics()
        self.model_thread = ModelThread()  # the engine is not thread-safe: every call to it goes through this one
        ledger = _ledger_name() if replica is not None else None
        self.admission = Admission(
            self.engine, self.metrics, self.replica, ledger, s.batching.rows_per_request, s.retry_after_s
        )
        self.admission.pace.enabled = s.batching.realtime_admission
        self.report = ReplicaReport(self.replica, self.engine, self.model_thread, self.metrics)
        # Batching across requests happens only in a Serve replica; in-process (and in Serve's local testing mode)
        # requests run one by one, as before.
        self._batching = s.batching.enabled and replica is not None
        self.batcher = ContinuousBatcher(
            self._generate_many,
            s.batching.max_batch_size,
            s.batching.batch_wait_timeout_s,
            wants_company=lambda batch: starts_session(self.engine.store, batch),
            rows_of=len,
            max_batch_rows=self.engine.max_batch_rows,
            class_of=traffic_class,
            deadline_of=earliest_deadline,
            sessions_of=lambda batch: batch.session_ids,
            call_ms=self.admission.cost.predict,
            floor_calls=s.batching.batch_floor_calls,
            clock=time.time,  # deadline_at is wall clock (the door's)
        )
        self.batcher.classes = s.batching.traffic_classes
        self._submitted: dict[int, float] = {}  # id(batch) -> when it reached the batcher (monotonic)
        log.info("policy replica %s ready in %.1f s", self.replica, time.perf_counter() - t0)

    # --- request path -----------------------------------------------------------------------------------------
    async def generate(self, batch: ModelBatch, limits: SessionLimits | None = None) -> PolicyOutput:
        """One request's rows of a chunk; `limits`: its tenant's session quotas (checked when it is admitted)."""
        if not isinstance(batch, ModelBatch) or len(batch) == 0:
            raise InvalidRequest("the policy needs a ModelBatch with at least one session row")
        await self.admission.enter(batch, limits)  # 413 beyond the row limits
        key = self.report.routing_keys.enter(batch)
        # a farm's request is cut to what a robot can wait out (deployments.batch_slices); one part otherwise
        parts = self._parts(batch)
        self.admission.share(batch, parts)
        for part in parts:
            self._submitted[id(part)] = time.monotonic()
        try:
            if self._batching:
                outcomes = await asyncio.gather(*(self.batcher.submit(part) for part in parts))
            else:
                outcomes = await self._generate_many(parts)
        finally:
            for part in parts:
                self._submitted.pop(id(part), None)
                self.admission.leave(part)
            self.report.routing_keys.leave(key)
            self.admission.leave(batch)
        for outcome in outcomes:
            if outcome.error is not None:
                raise outcome.error
        self.report.deadlines_checked(batch, time.time())
        if len(outcomes) == 1:
            return outcomes[0].output
        outputs = [o.output for o in outcomes]
        joined = join_results([o.result for o in outputs])
        return PolicyOutput(joined, self.replica, max(o.batch_requests for o in outputs))

    def _parts(self, batch: ModelBatch) -> list[ModelBatch]:
        """A batch-class request while robots state budgets: slices of the rows a robot can wait out."""
        if not self._batching or not self.batcher.classes or traffic_class(batch) != "batch":
            return [batch]
        return slices(batch, self.batcher.slice_rows())

    async def _generate_many(self, batches: list[ModelBatch]) -> list[_Outcome]:
        self.metrics.batch_requests.observe(len(batches))
        now = time.monotonic()
        for b in batches:  # queue time per class: submitted -> taken into this call
            self.report.taken(traffic_class(b), (now - self._submitted.get(id(b), now)) * 1000.0)
        busy = {sid for b in batches + self.batcher.queued() for sid in b.session_ids}  # never evicted for room
        # One trip to the model thread per batch (admission, then every group's model call): each thread hop is a
        # wake-up each way, a visible share of a small model's call on a busy CPU.
        default_seed = int(self.engine.pipeline.config.default_seed)
        outcomes, calls = await self.model_thread.run(self._admit_and_run, batches, busy, default_seed)
        for rows, _, ms, _ in calls:
            self.admission.cost.add(rows, ms)  # the measured cost per row: realtime admission and the batcher
        self.report.calls_done(calls)
        return outcomes

    def _admit_and_run(
        self, batches: list[ModelBatch], busy: set[str], default_seed: int
    ) -> tuple[list[_Outcome], list[tuple[int, list, float, int]]]:
        """Model thread: admit each request's sessions, then run the admitted ones in compatible groups.

        Returns an outcome per request and (rows, session reports, ms, realtime rows) per model call. A request
        refused at admission (capacity, bad input) or a group whose call fails gets its error; the others are served.
        """
        outcomes: list[_Outcome | None] = [None] * len(batches)
        for i, exc in self.admission.admit_each(batches, busy).items():  # admission per request, before merging
            outcomes[i] = _Outcome(error=exc)
        admitted = [i for i in range(len(batches)) if outcomes[i] is None]
        calls: list[tuple[int, list, float, int]] = []
        try:
            for part in plan_groups([batches[i] for i in admitted]):
                members = [admitted[j] for j in part]
                group = [batches[i] for i in members]
                try:
                    merged = merge_batches(group, default_seed)
                    t0 = time.perf_counter()
                    if self.recorder is None:
                        result = self.engine.generate(merged, self.return_latents)
                    else:
                        result = run_recorded(self.engine, self.recorder, merged, self.return_latents)
                    call_ms = (time.perf_counter() - t0) * 1000.0
                    result.timings_ms = {**result.timings_ms, "model_call": call_ms}
                    for i, out in zip(members, split_result(result, [len(b) for b in group])):
                        bad = _non_finite_actions(out)  # a NaN action never reaches a robot
                        outcomes[i] = _Outcome(
                            PolicyOutput(out, self.replica, len(group)) if bad is None else None, bad
                        )
                    calls.append((len(merged), result.sessions, call_ms, sum(len(realtime_rows(b)) for b in group)))
                except Exception as exc:  # noqa: BLE001 - handed back to exactly the requests of this group
                    for i in members:
                        outcomes[i] = _Outcome(error=exc)
        finally:
            # ids of requests that never reached the model give their reservation back
            self.engine.store.release([sid for i in admitted for sid in batches[i].session_ids])
        return outcomes, calls

    # --- live tuning (Serve user_config: deployments.live_tuning) ----------------------------------------------
    def reconfigure(self, user_config: dict | None, rank: object = None) -> None:
        """Serve calls this at start and on every `user_config` change of a `serve deploy`, without a restart.

        `rank` is unused: taking it makes Serve call this when a deploy removes `user_config` too (None: back to the
        `args` values), which it skips for a method without it."""
        from deployments.live_tuning import apply_live_tuning, parse_live_tuning

        self.tuning = apply_live_tuning(self, parse_live_tuning(user_config))
        log.info("policy replica %s: live settings now %s", self.replica, self.tuning)

    def tuning_in_effect(self) -> dict:
        """The live knobs as this replica runs them (the `args` values until a `user_config` changes them)."""
        from deployments.live_tuning import apply_live_tuning, parse_live_tuning

        return getattr(self, "tuning", None) or apply_live_tuning(self, parse_live_tuning({}))

    # --- session control --------------------------------------------------------------------------------------
    async def drop_sessions(self, session_ids: list[str]) -> int:
        """Free sessions (a WebSocket connection closed); unknown ids are ignored."""
        await self.model_thread.run(self.engine.drop_sessions, list(session_ids))
        self.admission.pace.forget(session_ids)  # a closed connection's robot no longer counts at pace
        if self.recorder is not None:
            self.recorder.end(session_ids)  # a closed connection's session: its segment is written now
        self.report.sessions_ended(list(session_ids))
        return len(session_ids)

    async def reset_sessions(self, session_ids: list[str]) -> int:
        """Restart sessions at their next call, flagged "reset_requested" (the ZMQ door's `reset`)."""
        await self.model_thread.run(self.engine.reset_sessions, list(session_ids))
        self.report.sessions_reset(list(session_ids))
        return len(session_ids)

    # --- introspection (deployments.replica_report) -----------------------------------------------------------
    def stats(self) -> dict:
        """This replica's session store (live sessions, bytes held and reserved, budget, evictions, restarts) and its
        traffic per class (`traffic`: requests, rows, mean queue ms, deadline misses; realtime sessions at pace)."""
        traffic = {**self.report.traffic(), "realtime_sessions": self.admission.pace.admitted()}
        return {**self.report.stats(), "traffic": traffic}

    async def record_routing_stats(self) -> dict:
        """The routing keys of the sessions this replica holds, for SessionRouter (polled by Serve's controller).

        Runs on the replica's event loop and never waits for the model thread, so a long model call never delays it.
        """
        self.admission.keep_ledger_fresh()  # the other replicas' view of this one stays fresh while no request comes
        return self.report.routing_stats()

    def info(self) -> dict:
        return self.report.info(self._batching)

    def ready(self) -> bool:
        """True when this replica can serve (the ingress's /health asks every deployment); NotReady (503) says why
        not: no pipeline, or a model call stuck on the model thread past `STUCK_CALL_S`."""
        problem = self.report.unservable()
        if problem is not None:
            raise NotReady(f"policy replica {self.replica}: {problem}")
        return True

    def check_health(self) -> None:
        # Serve calls this periodically; an unservable replica is replaced (its sessions restart, flagged).
        problem = self.report.unservable()
        if problem is not None:
            raise RuntimeError(problem)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        model_thread = getattr(self, "model_thread", None)
        if model_thread is not None:
            model_thread.close()
