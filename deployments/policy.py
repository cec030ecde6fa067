"""Policy deployment: the only holder of the model and of per-session state (one instance per replica).

Concurrent requests are merged by a continuous batcher (`deployments.batcher`: a batch forms when the model is free,
waiting at most `batch_wait_timeout_s` for the clients of the previous batch) into as few model calls as possible.
Requests are only merged when their arrays stack and when they share no session (`deployments.batch_merge`). Inside a
model call every row shares the same forwards, whatever its session's frame position (restarting rows add one
prefill). A failing group fails only its own requests.

Memory is admitted per request before requests are merged (dreamzero.sessions, docs/model.md "Memory and admission"):
a request whose sessions do not fit the byte budget gets CapacityError (503 + Retry-After) alone; batches are bounded
in session rows (`max_batch_rows`) and a request larger than a batch or than `rows_per_request` gets 413.

Tenants (deployments.tenants): session ids arrive scoped by tenant; the store evicts within a tenant over its share
first, a request may carry its tenant's session quotas (`SessionLimits`, checked at admission: 429 beyond them; the
total across replicas through the tenant ledger), and session starts, resets, evictions and ends are audited.
"""

# Longer than ~400 lines on purpose: the one model holder, its request path (admission, quotas, batching) and the
# replica's reports (health, routing stats, gauges, audit) share its state.

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from ray import serve

from deployments.audit import configure_audit_log, one_line_refusals
from deployments.batch_merge import merge_batches, plan_groups, split_result
from deployments.batcher import ContinuousBatcher
from deployments.metrics import serving_metrics
from deployments.routing import STATS_KEYS, STATS_SESSIONS, HeldKeys
from deployments.sections import ReplayArgs
from deployments.settings import EmbodimentSource, PolicySettings
from deployments.tenant_ledger import LedgerLink
from deployments.tenants import SessionLimits, audit, audit_refusal, audit_reports, tenant_of
from dreamzero.embodiments.base import MAX_NORMALISED_STATE
from dreamzero.errors import (
    CapacityError,
    ConfigError,
    InvalidObservation,
    InvalidRequest,
    NotReady,
    PayloadTooLarge,
    QuotaExceeded,
)
from dreamzero.types import ChunkResult, ModelBatch

log = logging.getLogger("dreamzero.serve.policy")

#: a model call running longer than this means a hung device or a deadlock: the replica reports itself unhealthy and
#: Serve replaces it. Far above any chunk (a 14B batch of 8 rows takes seconds; a CPU warm-up is done in __init__).
STUCK_CALL_S = 600.0


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


class CpuThreads:
    """Torch intra-op threads per model call on CPU: one per `rows_per_thread` rows, at most `max_threads`.

    Ray pins a replica to OMP_NUM_THREADS = num_cpus (1 when 0). A second thread speeds a wide batch up (its matrices
    are big enough to split) but not a single row, whose small ops then only spin a core that the request path of
    the other clients (ingress, proxy) needs; so small calls run on one thread and wide ones on more.
    """

    def __init__(self, max_threads: int, rows_per_thread: int):
        self.max_threads, self.rows_per_thread = max_threads, max(1, rows_per_thread)
        self.current: int | None = None

    def for_rows(self, rows: int) -> int:
        return max(1, min(self.max_threads, rows // self.rows_per_thread))

    def use_for(self, rows: int) -> int:
        import torch

        n = self.for_rows(rows)
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n
        return n


def load_pipeline(**kwargs: Any):
    """Load the model pipeline (imported lazily: the module stays importable without the model stack)."""
    from dreamzero.pipeline import DreamZeroPipeline

    return DreamZeroPipeline.load(**kwargs)


def load_replay(replay: ReplayArgs, embodiment: EmbodimentSource, max_sessions: int):
    """A LeRobot episode's recorded actions behind the pipeline interface (`policy.replay` in serve_config.yaml)."""
    from deployments.preprocess import load_embodiment
    from deployments.replay import ReplayPipeline

    emb = load_embodiment(embodiment)
    return ReplayPipeline(
        emb, replay.dataset, replay.episode, replay.stride, replay.action_columns, max_sessions=max_sessions
    )


def replica_plan(s: PolicySettings):
    """The memory plan of this replica's device (dreamzero.planner): None on a plain CPU; ConfigError when the model
    does not fit, naming what would."""
    from dreamzero.planner import plan_for_replica

    return plan_for_replica(
        s.model_path, s.checkpoint_layout, s.checkpoint_config, s.pipeline, s.device, s.dtype, s.cfg_parallel,
        s.sessions.max_sessions, s.batching.max_batch_rows, s.sessions.max_bytes, s.placement,
    )  # fmt: skip


def fixed_placement(fields: dict[str, str]):
    """`policy.placement` on a device without memory to plan (the CPU): the fields set, the rest as default."""
    from dreamzero.placement import Placement
    from dreamzero.planner import explicit_placement

    return Placement(**explicit_placement(fields))


def start_cfg_rank(load_kwargs: dict, settings: PolicySettings):
    """Start this replica's CFG rank 1 (`policy.cfg_parallel: 2`; imported lazily: Ray-actor code)."""
    from deployments.cfg_rank import CfgPeer

    return CfgPeer(load_kwargs, settings.cfg_timeout_s, settings.cfg_rank_options)


def rows_without_device(rows_spec: int | str | None, max_sessions: int) -> int:
    """`batching.max_batch_rows` where no device memory bounds a batch (the replay policy)."""
    from dreamzero.pipeline.budget import CPU_AUTO_ROWS

    if rows_spec == "auto":
        return min(CPU_AUTO_ROWS, max_sessions)
    return int(rows_spec or max_sessions)


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


def _check_state_range(batch: ModelBatch) -> None:
    """InvalidObservation naming the state when a row's normalised state is not finite or beyond
    `MAX_NORMALISED_STATE` (the model would answer NaN: a finite 1e30 overflows its first layer)."""
    state = np.asarray(batch.state, dtype=np.float64)
    if not np.isfinite(state).all() or (state.size and np.abs(state).max() > MAX_NORMALISED_STATE):
        raise InvalidObservation(
            f"the normalised state holds values that are not finite or beyond +-{MAX_NORMALISED_STATE:g} (training "
            "data lies within about +-1): check the state's units",
            field="input.observation.state",
        )


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
    """Owns a DreamZeroPipeline (model + bounded session store) and serves chunks for batches of sessions."""

    def __init__(self, settings: PolicySettings | None = None):
        t0 = time.perf_counter()
        s = self.settings = settings or PolicySettings()
        sessions, batching = s.sessions, s.batching
        self._threads = (
            CpuThreads(s.torch_threads, s.rows_per_thread) if s.torch_threads and s.device == "cpu" else None
        )
        self.rows_per_request = batching.rows_per_request
        self.memory: dict | None = None  # rows, byte budget and device settled at start (GET /v1/models)
        self._peer = None  # policy.cfg_parallel: 2: rank 1 of this replica (deployments.cfg_rank)
        if s.replay is not None:  # recorded actions instead of a model (deployments/replay.py); no tensors to budget
            self.pipeline = load_replay(s.replay, s.embodiment, sessions.max_sessions)
            self.pipeline.store.retry_after_s = s.retry_after_s
            self.max_batch_rows = rows_without_device(batching.max_batch_rows, sessions.max_sessions)
        else:
            plan = replica_plan(s)  # placement and precision, before any weight is read; None on a plain CPU
            load_kwargs = dict(
                model_path=s.model_path,
                layout=s.checkpoint_layout,
                config=s.checkpoint_config,
                tokenizer_path=s.tokenizer_path,
                device=s.device,
                dtype=s.dtype,
                overrides=dict(s.pipeline) or None,
                placement=plan.placement if plan is not None else fixed_placement(s.placement),
            )
            if s.cfg_parallel == 2:
                self._peer = start_cfg_rank(load_kwargs, s)  # rank 1 loads meanwhile; joined after the sizing
            self.pipeline = load_pipeline(
                **load_kwargs, max_sessions=sessions.max_sessions, session_ttl_s=sessions.ttl_s
            )
            # sized as one device holding both branches (a warm-up of the whole loop): rows as chosen there, and
            # sessions then hold one branch's bytes per rank (a cfg_parallel: 2 replica fits more of them)
            self._size_memory(batching.max_batch_rows, sessions.max_bytes, s.retry_after_s)
            if plan is not None:
                self.memory = {**(self.memory or {}), "plan": plan.as_dict()}
                log.info("policy replica plan: %s", plan.summary())
            if self._peer is not None:
                self._peer.join(self.pipeline, sessions.max_sessions + 2 * self.max_batch_rows)
                self.memory = {**(self.memory or {}), "topology": self._peer.topology(static=True)}
        replica = _replica_name()
        self.replica = replica or f"local-{uuid.uuid4().hex[:8]}"
        if replica is not None:  # in a Serve replica: the audit log is written, refusals log one line each
            configure_audit_log()
            one_line_refusals()
        self.return_latents = s.return_latents
        self.recorder = video_recorder(s) if s.replay is None else None  # `video.save_dir`; None: off
        self.metrics = serving_metrics()
        # The pipeline is not thread-safe: every model / session-store call goes through this one thread, which also
        # keeps the replica's event loop free to accept (and batch) requests while a chunk computes.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dreamzero-model")
        self._busy_since: float | None = None  # monotonic start of the model call running now
        # Batching across requests happens only in a Serve replica; in-process (and in Serve's local testing mode)
        # requests run one by one, as before.
        self._batching = batching.enabled and replica is not None
        self._batcher = ContinuousBatcher(
            self._generate_many,
            batching.max_batch_size,
            batching.batch_wait_timeout_s,
            wants_company=self._starts_session,
            rows_of=len,
            max_batch_rows=self.max_batch_rows,
        )
        self._evictions_seen = 0
        self._routing_keys = HeldKeys()  # routing key -> session ids, for record_routing_stats
        self._limits: dict[int, SessionLimits] = {}  # id(batch) -> its tenant's session quotas, while it is admitted
        self._ledger: LedgerLink | None = None  # started by the first request with a total session quota
        self._tenants_seen: set[str] = set()  # tenants with a live-session gauge (set to 0 when they leave)
        store = self.pipeline.store  # the model's or the replay's: both keep sessions by tenant
        store.group_of = tenant_of
        store.on_evict = lambda sid, cause: audit("evict", sid, self.replica, f"cause={cause}")
        log.info("policy replica %s ready in %.1f s", self.replica, time.perf_counter() - t0)

    # --- request path -----------------------------------------------------------------------------------------
    async def generate(self, batch: ModelBatch, limits: SessionLimits | None = None) -> PolicyOutput:
        """One request's rows of a chunk; `limits`: its tenant's session quotas (checked when it is admitted)."""
        if not isinstance(batch, ModelBatch) or len(batch) == 0:
            raise InvalidRequest("the policy needs a ModelBatch with at least one session row")
        self._check_rows(len(batch))
        if limits is not None and limits.total is not None:
            await self._refresh_ledger()
        key = self._routing_keys.enter(batch)
        if limits is not None:
            self._limits[id(batch)] = limits
        try:
            if self._batching:
                outcome = await self._batcher.submit(batch)
            else:
                (outcome,) = await self._generate_many([batch])
        finally:
            self._routing_keys.leave(key)
            self._limits.pop(id(batch), None)
        if outcome.error is not None:
            raise outcome.error
        return outcome.output

    async def _generate_many(self, batches: list[ModelBatch]) -> list[_Outcome]:
        self.metrics.batch_requests.observe(len(batches))
        busy = {sid for b in batches + self._batcher.queued() for sid in b.session_ids}  # never evicted for room
        # One trip to the model thread per batch (admission, then every group's model call): each thread hop is a
        # wake-up each way, a visible share of a small model's call on a busy CPU.
        outcomes, calls = await self._on_model_thread(self._admit_and_run, batches, busy, self._default_seed())
        for rows, sessions in calls:
            self.metrics.batch_rows.observe(rows)
            self.metrics.observe_sessions(sessions)
            audit_reports(sessions, self.replica)
        self._update_session_gauges()
        return outcomes

    def _admit_and_run(
        self, batches: list[ModelBatch], busy: set[str], default_seed: int
    ) -> tuple[list[_Outcome], list[tuple[int, list]]]:
        """Model thread: admit each request's sessions, then run the admitted ones in compatible groups.

        Returns an outcome per request and (rows, session reports) per model call. A request refused at admission
        (capacity, bad input) or a group whose call fails gets its error; the others are served.
        """
        outcomes: list[_Outcome | None] = [None] * len(batches)
        for i, exc in self._admit_each(batches, busy).items():  # admission per request, before merging
            outcomes[i] = _Outcome(error=exc)
        admitted = [i for i in range(len(batches)) if outcomes[i] is None]
        calls: list[tuple[int, list]] = []
        try:
            for part in plan_groups([batches[i] for i in admitted]):
                members = [admitted[j] for j in part]
                group = [batches[i] for i in members]
                try:
                    merged = merge_batches(group, default_seed)
                    t0 = time.perf_counter()
                    result = self._run_model(merged) if self.recorder is None else self._run_recorded(merged)
                    result.timings_ms = {**result.timings_ms, "model_call": (time.perf_counter() - t0) * 1000.0}
                    for i, out in zip(members, split_result(result, [len(b) for b in group])):
                        bad = _non_finite_actions(out)  # a NaN action never reaches a robot
                        outcomes[i] = _Outcome(
                            PolicyOutput(out, self.replica, len(group)) if bad is None else None, bad
                        )
                    calls.append((len(merged), result.sessions))
                except Exception as exc:  # noqa: BLE001 - handed back to exactly the requests of this group
                    for i in members:
                        outcomes[i] = _Outcome(error=exc)
        finally:
            # ids of requests that never reached the model give their reservation back
            self.pipeline.store.release([sid for i in admitted for sid in batches[i].session_ids])
        return outcomes, calls

    def _admit_each(self, batches: list[ModelBatch], busy: set[str]) -> dict[int, BaseException]:
        """Admit each request's sessions (model thread); index -> error for those refused (capacity or bad input)."""
        refused: dict[int, BaseException] = {}
        for i, batch in enumerate(batches):
            try:
                _check_state_range(batch)
                limits = self._limits.get(id(batch))
                if limits is not None:
                    self._check_session_quota(batch, limits)
                self.pipeline.admit(batch, busy)
            except Exception as exc:  # noqa: BLE001 - capacity, quota or bad input fails its own request only
                if isinstance(exc, CapacityError):
                    self.metrics.admissions_refused.inc()
                refused[i] = exc
                audit_refusal(tenant_of(batch.session_ids[0]), "policy", exc, len(batch))
        return refused

    def _check_session_quota(self, batch: ModelBatch, limits: SessionLimits) -> None:
        """Model thread: QuotaExceeded when the batch's new sessions take its tenant past a session quota (the total
        counts the other replicas' sessions as the ledger last said)."""
        store = self.pipeline.store
        elsewhere = self._ledger.others.get(limits.tenant, 0) if self._ledger is not None else 0
        try:
            store.check_group_room(batch.session_ids, limits.per_replica, limits.total, elsewhere, label="tenant")
        except QuotaExceeded as exc:
            self.metrics.tenant_quota_refusals.inc(1, tags={"tenant": limits.tenant, "quota": exc.quota})
            raise

    async def _refresh_ledger(self) -> None:
        """Report this replica's live sessions per tenant to the ledger and read the others' (at most once a
        second); only inside a Serve replica (in-process, this replica is the only one)."""
        if self._ledger is None:
            if _replica_name() is None:
                return
            self._ledger = LedgerLink(_ledger_name(), self.replica, self._tenant_counts)
        await self._ledger.refresh()

    def _tenant_counts(self) -> dict[str, int]:
        return self.pipeline.store.group_counts()

    def _starts_session(self, batch: ModelBatch) -> bool:
        """Does this request start (or reset) a session? Such requests wait for company (deployments.batcher)."""
        store = self.pipeline.store
        if batch.reset_mask and any(batch.reset_mask):
            return True
        return any(sid not in store for sid in batch.session_ids)

    def _run_model(self, batch: ModelBatch) -> ChunkResult:
        threads = self._threads.use_for(len(batch)) if self._threads is not None else None
        if self._peer is not None:  # both ranks, in lock-step; rank 0's result is the answer
            return self._peer.run(
                lambda: self.pipeline.generate(batch, return_latents=self.return_latents), batch, threads
            )
        if self.return_latents:
            return self.pipeline.generate(batch, return_latents=True)
        return self.pipeline.generate(batch)

    def _run_recorded(self, batch: ModelBatch) -> ChunkResult:
        """`video.save_dir`: every row's frames are decoded for the recorder; the reply keeps only those asked for."""
        asked = batch.return_video
        batch.return_video = [True] * len(batch)
        try:
            result = self._run_model(batch)
        finally:
            batch.return_video = asked
        for i, (report, frames) in enumerate(zip(result.sessions, result.video or ())):
            self.recorder.add(report.session_id, report.incarnation, frames, batch.images[i])
        keep = asked or [False] * len(batch)
        video = [v if k else None for v, k in zip(result.video or (), keep)]
        result.video = video if any(keep) else None
        return result

    # --- live tuning (Serve user_config: deployments.live_tuning) ----------------------------------------------
    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this at start and on every `user_config` change of a `serve deploy`, without a restart."""
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
        await self._on_model_thread(self.pipeline.drop_sessions, list(session_ids))
        if self.recorder is not None:
            self.recorder.end(session_ids)  # a closed connection's session: its segment is written now
        for sid in session_ids:
            audit("end", sid, self.replica)
        self._update_session_gauges()
        return len(session_ids)

    async def reset_sessions(self, session_ids: list[str]) -> int:
        """Restart sessions at their next call, flagged "reset_requested" (the ZMQ door's `reset`)."""
        await self._on_model_thread(self.pipeline.reset_sessions, list(session_ids))
        for sid in session_ids:
            audit("reset", sid, self.replica, "asked")
        return len(session_ids)

    # --- introspection ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """This replica's session store: live sessions, bytes held and reserved, budget, evictions, restarts."""
        stats = {"replica": self.replica, **self.pipeline.stats()}
        if self._peer is not None:
            stats["topology"] = self._peer.topology()
        return stats

    async def record_routing_stats(self) -> dict:
        """The routing keys of the sessions this replica holds, for SessionRouter (polled by Serve's controller).

        Runs on the replica's event loop and only reads the store's index (membership tests, atomic under the GIL),
        so a long model call never delays it.
        """
        keys, sessions = self._routing_keys.live(self.pipeline.store)
        if self._ledger is not None:  # keep the other replicas' view of this one fresh while no request comes
            asyncio.ensure_future(self._ledger.refresh())
        return {STATS_KEYS: keys, STATS_SESSIONS: sessions}

    def info(self) -> dict:
        loop_cfg = self.pipeline.config  # PipelineConfig: the inference-loop knobs in effect
        model_cfg = getattr(getattr(self.pipeline, "model", None), "config", None)  # DreamZeroConfig when known
        dit_cfg = getattr(model_cfg, "dit", None)
        return {
            "replica": self.replica,
            "config_name": getattr(model_cfg, "name", "custom"),
            "embodiment_tag": getattr(model_cfg, "embodiment_tag", None),
            "action_horizon": int(self.pipeline.action_horizon),
            "max_action_dim": int(self.pipeline.max_action_dim),
            "max_state_dim": int(getattr(dit_cfg, "max_state_dim", 64)),
            "default_seed": self._default_seed(),
            "num_inference_steps": int(loop_cfg.num_inference_steps),
            "batching": self._batching,
            "max_batch_rows": int(self.max_batch_rows),
            "memory": self.memory,
            "cfg_parallel": 1 if self._peer is None else 2,
        }

    def ready(self) -> bool:
        """True when this replica can serve (the ingress's /health asks every deployment); NotReady (503) says why
        not: no pipeline, or a model call stuck on the model thread past `STUCK_CALL_S`."""
        problem = self._unservable()
        if problem is not None:
            raise NotReady(f"policy replica {self.replica}: {problem}")
        return True

    def check_health(self) -> None:
        # Serve calls this periodically; an unservable replica is replaced (its sessions restart, flagged).
        problem = self._unservable()
        if problem is not None:
            raise RuntimeError(problem)

    def _unservable(self) -> str | None:
        if getattr(self, "pipeline", None) is None:
            return "the model pipeline is not loaded"
        since = self._busy_since
        if since is not None and time.monotonic() - since > STUCK_CALL_S:
            return f"a model call has been running for {time.monotonic() - since:.0f} s (limit {STUCK_CALL_S:g} s)"
        if self._peer is not None:
            return self._peer.health()
        return None

    async def _on_model_thread(self, fn, *args):
        """Run `fn(*args)` on the one model thread, noting when it started (for `ready` / `check_health`)."""

        def timed():
            self._busy_since = time.monotonic()
            try:
                return fn(*args)
            finally:
                self._busy_since = None

        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    def __del__(self) -> None:
        peer = getattr(self, "_peer", None)
        if peer is not None:
            peer.close()
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    # --- helpers ----------------------------------------------------------------------------------------------
    def _size_memory(self, rows_spec: int | str | None, bytes_spec: int | str | None, retry_after_s: float) -> None:
        """`batching.max_batch_rows` and `sessions.max_bytes` for this replica's device (auto: from a warm-up of the
        largest batch, measured on a GPU, accounted on a simulated one; docs/model.md "Memory and admission")."""
        from dreamzero.pipeline.budget import resolve_serving_memory

        store = self.pipeline.store
        store.retry_after_s = retry_after_s
        memory = resolve_serving_memory(self.pipeline, rows_spec, bytes_spec, store.max_sessions, log.info)
        self.max_batch_rows, store.max_bytes, self.memory = memory.rows, memory.budget, memory.as_dict()
        log.info(
            "policy replica memory: %d rows per model call (batching.max_batch_rows=%s), session budget %s%s",
            memory.rows,
            rows_spec,
            "none" if memory.budget is None else f"{memory.budget / 2**30:.2f} GiB",
            "" if memory.device is None else f" on {memory.device}",
        )

    def _check_rows(self, rows: int) -> None:
        for limit, name in (
            (self.rows_per_request, "batching.rows_per_request"),
            (self.max_batch_rows, "batching.max_batch_rows"),
        ):
            if limit is not None and rows > limit:
                raise PayloadTooLarge(f"the request holds {rows} session rows, more than {name}={limit}; split it")

    def _default_seed(self) -> int:
        return int(self.pipeline.config.default_seed)

    def _update_session_gauges(self) -> None:
        stats = self.pipeline.stats()  # SessionStore.stats(): live, bytes, reserved_bytes, max_bytes, evictions, ...
        self.metrics.live_sessions.set(float(stats["live"]))
        self.metrics.observe_session_bytes(stats.get("reserved_bytes"), stats["bytes"], stats.get("max_bytes"))
        if stats["evictions"] > self._evictions_seen:
            self.metrics.evictions.inc(stats["evictions"] - self._evictions_seen)
            self._evictions_seen = stats["evictions"]
        counts = self._tenant_counts()
        for tenant in self._tenants_seen | set(counts):
            self.metrics.tenant_live_sessions.set(float(counts.get(tenant, 0)), tags={"tenant": tenant})
        self._tenants_seen = set(counts)
