"""A Policy replica's engine: what runs its model calls and holds its sessions, one interface over three kinds.

`policy` in serve_config.yaml picks the kind (`load_engine`); each kind's `load(settings, store_options)` is one of the
replica's load modes:

- `ModelEngine` (by default): the DreamZero pipeline on this replica's device, planned before any weight is read
  (`dreamzero.planner`) and sized after loading (rows per call, session bytes; docs/model.md "Memory and admission").
- `CfgPairEngine` (`policy.cfg_parallel: 2`): the same pipeline as rank 0 (the conditional branch, the session store
  that decides), with rank 1, a Ray actor, running the unconditional branch in lock-step (`deployments.cfg_rank`).
- `ReplayEngine` (`policy.replay`): a LeRobot episode's recorded actions (`deployments.replay`); nothing to size.

Every engine builds its session store itself, from the replica's `StoreOptions` (its tenants' groups, its eviction
audit, the Retry-After of a refusal). Engines are not thread-safe: the replica calls them on its one `ModelThread`,
all but the reads that are safe from its event loop (`stats`, `health`, the store's index).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from deployments.config.settings import PolicySettings
    from dreamzero.types import ChunkResult, ModelBatch

log = logging.getLogger("dreamzero.serve.policy")


class Engine(Protocol):
    """What a Policy replica asks of its engine (`ModelEngine`, `CfgPairEngine`, `ReplayEngine`)."""

    #: the session holder (`DreamZeroPipeline` or `ReplayPipeline`): `store`, `config` (the loop knobs, replaced by a
    #: live `user_config`), `model`, `action_horizon`, `max_action_dim`
    pipeline: Any
    max_batch_rows: int  # the most session rows one model call takes (sized at start)
    memory: dict | None  # what was sized and planned at start (GET /v1/models), None when nothing was
    cfg_parallel: int  # 1, or 2 for the CFG-parallel pair

    @property
    def store(self) -> Any: ...

    def admit(self, batch: ModelBatch, busy: set[str]) -> None: ...

    def generate(self, batch: ModelBatch, return_latents: bool = False) -> ChunkResult: ...

    def reset_sessions(self, session_ids: list[str]) -> None: ...

    def drop_sessions(self, session_ids: list[str]) -> Any: ...

    def stats(self) -> dict: ...

    def health(self) -> str | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StoreOptions:
    """How a replica's session store groups and reports its sessions, given to the store's constructor."""

    group_of: Callable[[str], str] | None = None  # session id -> tenant (share-first eviction, quotas)
    on_evict: Callable[[str, str], None] | None = None  # (session id, cause): the audit line of an eviction
    retry_after_s: float = 5.0  # Retry-After of a capacity refusal


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


def cpu_threads(s: PolicySettings) -> CpuThreads | None:
    """`policy.torch_threads` on a CPU replica; None leaves torch's count as Ray set it."""
    return CpuThreads(s.torch_threads, s.rows_per_thread) if s.torch_threads and s.device == "cpu" else None


class ModelThread:
    """The one thread every engine call runs on; it keeps the replica's event loop free to accept (and batch)
    requests while a chunk computes, and says since when a call runs (for the replica's health)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dreamzero-model")
        self.busy_since: float | None = None  # monotonic start of the call running now

    async def run(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` on the model thread, noting when it started."""

        def timed():
            self.busy_since = time.monotonic()
            try:
                return fn(*args)
            finally:
                self.busy_since = None

        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class PipelineEngine:
    """What the three engines share: a pipeline's session interface, called on the model thread."""

    cfg_parallel = 1

    def __init__(self, pipeline: Any, max_batch_rows: int, threads: CpuThreads | None = None):
        self.pipeline = pipeline
        self.max_batch_rows = max_batch_rows
        self.memory: dict | None = None
        self.threads = threads

    @property
    def store(self) -> Any:
        return self.pipeline.store

    def admit(self, batch: ModelBatch, busy: set[str]) -> None:
        self.pipeline.admit(batch, busy)

    def generate(self, batch: ModelBatch, return_latents: bool = False) -> ChunkResult:
        self._use_threads(len(batch))
        if return_latents:
            return self.pipeline.generate(batch, return_latents=True)
        return self.pipeline.generate(batch)

    def reset_sessions(self, session_ids: list[str]) -> None:
        self.pipeline.reset_sessions(list(session_ids))

    def drop_sessions(self, session_ids: list[str]) -> Any:
        return self.pipeline.drop_sessions(list(session_ids))

    def stats(self) -> dict:
        return self.pipeline.stats()

    def health(self) -> str | None:
        return None

    def close(self) -> None:
        pass

    def _use_threads(self, rows: int) -> int | None:
        return self.threads.use_for(rows) if self.threads is not None else None


def load_pipeline(store: Any = None, **kwargs: Any):
    """Load the model pipeline (imported lazily: the module stays importable without the model stack); `store`, the
    replica's session store (its tenants' groups, its eviction audit), takes the place of the plain one it loads with.
    """
    from dreamzero.pipeline import DreamZeroPipeline

    pipeline = DreamZeroPipeline.load(**kwargs)
    if store is not None:
        pipeline.store = store
    return pipeline


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


def model_load_kwargs(s: PolicySettings, plan) -> dict[str, Any]:
    """What both CFG ranks (or the one pipeline) load: the checkpoint, device, loop overrides and placement."""
    return dict(
        model_path=s.model_path,
        layout=s.checkpoint_layout,
        config=s.checkpoint_config,
        tokenizer_path=s.tokenizer_path,
        device=s.device,
        dtype=s.dtype,
        overrides=dict(s.pipeline) or None,
        placement=plan.placement if plan is not None else fixed_placement(s.placement),
    )


def model_store(s: PolicySettings, options: StoreOptions):
    """Rank 0's session store; its byte budget is settled by `ModelEngine.size_memory` once the model is loaded."""
    from dreamzero.sessions import SessionStore

    return SessionStore(
        max_sessions=s.sessions.max_sessions,
        ttl_s=s.sessions.ttl_s,
        retry_after_s=options.retry_after_s,
        group_of=options.group_of,
        on_evict=options.on_evict,
    )


class ModelEngine(PipelineEngine):
    """The DreamZero pipeline on this replica's device."""

    @classmethod
    def load(cls, s: PolicySettings, options: StoreOptions) -> ModelEngine:
        plan = replica_plan(s)  # placement and precision, before any weight is read; None on a plain CPU
        pipeline = load_pipeline(**model_load_kwargs(s, plan), store=model_store(s, options))
        engine = cls(pipeline, 0, cpu_threads(s))
        engine.settle(s, plan)
        return engine

    def settle(self, s: PolicySettings, plan) -> None:
        """Size rows and session bytes for this device, and note the plan it was loaded by."""
        self.size_memory(s.batching.max_batch_rows, s.sessions.max_bytes)
        if plan is not None:
            self.memory = {**(self.memory or {}), "plan": plan.as_dict()}
            log.info("policy replica plan: %s", plan.summary())

    def size_memory(self, rows_spec: int | str | None, bytes_spec: int | str | None) -> None:
        """`batching.max_batch_rows` and `sessions.max_bytes` for this replica's device (auto: from a warm-up of the
        largest batch, measured on a GPU, accounted on a simulated one; docs/model.md "Memory and admission")."""
        from dreamzero.pipeline.budget import resolve_serving_memory

        store = self.pipeline.store
        memory = resolve_serving_memory(self.pipeline, rows_spec, bytes_spec, store.max_sessions, log.info)
        self.max_batch_rows, store.max_bytes, self.memory = memory.rows, memory.budget, memory.as_dict()
        log.info(
            "policy replica memory: %d rows per model call (batching.max_batch_rows=%s), session budget %s%s",
            memory.rows,
            rows_spec,
            "none" if memory.budget is None else f"{memory.budget / 2**30:.2f} GiB",
            "" if memory.device is None else f" on {memory.device}",
        )


class CfgPairEngine(ModelEngine):
    """`policy.cfg_parallel: 2`: the pipeline is rank 0; each call runs on both ranks (deployments.cfg_rank)."""

    cfg_parallel = 2

    def __init__(self, pipeline: Any, peer: Any, threads: CpuThreads | None = None):
        super().__init__(pipeline, 0, threads)
        self.peer = peer

    @classmethod
    def load(cls, s: PolicySettings, options: StoreOptions) -> CfgPairEngine:
        from deployments.cfg_rank import CfgPeer  # imported lazily: Ray-actor code

        plan = replica_plan(s)
        load_kwargs = model_load_kwargs(s, plan)
        peer = CfgPeer(load_kwargs, s.cfg_timeout_s, s.cfg_rank_options)  # rank 1 loads meanwhile
        try:
            engine = cls(load_pipeline(**load_kwargs, store=model_store(s, options)), peer, cpu_threads(s))
            # sized as one device holding both branches (a warm-up of the whole loop): rows as chosen there, and
            # sessions then hold one branch's bytes per rank (a cfg_parallel: 2 replica fits more of them)
            engine.settle(s, plan)
            peer.join(engine.pipeline, s.sessions.max_sessions + 2 * engine.max_batch_rows)
        except BaseException:
            peer.close()  # rank 1 does not outlive a replica that failed to start
            raise
        engine.memory = {**(engine.memory or {}), "topology": peer.topology(static=True)}
        return engine

    def generate(self, batch: ModelBatch, return_latents: bool = False) -> ChunkResult:
        threads = self._use_threads(len(batch))  # rank 1 runs its half on as many
        # both ranks, in lock-step; rank 0's result is the answer
        return self.peer.run(lambda: self.pipeline.generate(batch, return_latents=return_latents), batch, threads)

    def stats(self) -> dict:
        return {**self.pipeline.stats(), "topology": self.peer.topology()}

    def health(self) -> str | None:
        return self.peer.health()

    def close(self) -> None:
        self.peer.close()


def rows_without_device(rows_spec: int | str | None, max_sessions: int) -> int:
    """`batching.max_batch_rows` where no device memory bounds a batch (the replay policy)."""
    from dreamzero.pipeline.budget import CPU_AUTO_ROWS

    if rows_spec == "auto":
        return min(CPU_AUTO_ROWS, max_sessions)
    return int(rows_spec or max_sessions)


class ReplayEngine(PipelineEngine):
    """A LeRobot episode's recorded actions behind the pipeline interface (`policy.replay` in serve_config.yaml)."""

    @classmethod
    def load(cls, s: PolicySettings, options: StoreOptions) -> ReplayEngine:
        from deployments.preprocess import load_embodiment
        from deployments.replay import ReplayPipeline, ReplayStore

        replay, max_sessions = s.replay, s.sessions.max_sessions
        store = ReplayStore(max_sessions, options.retry_after_s, options.group_of, options.on_evict)
        pipeline = ReplayPipeline(
            load_embodiment(s.embodiment), replay.dataset, replay.episode, replay.stride, replay.action_columns,
            max_sessions=max_sessions, store=store,
        )  # fmt: skip
        return cls(pipeline, rows_without_device(s.batching.max_batch_rows, max_sessions), cpu_threads(s))


def load_engine(s: PolicySettings, options: StoreOptions) -> Engine:
    """The engine `policy` asks for: recorded actions, the CFG-parallel pair, or the model on one device."""
    if s.replay is not None:
        return ReplayEngine.load(s, options)
    if s.cfg_parallel == 2:
        return CfgPairEngine.load(s, options)
    return ModelEngine.load(s, options)
