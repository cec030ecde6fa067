"""`policy.cfg_parallel: 2`: the second rank of a Policy replica, a Ray actor running the unconditional branch.

The Policy replica is rank 0 (the conditional branch, the session store that decides, the answers); `CfgRankActor`
is rank 1, created by the replica (so it lives and dies with it, and on GPU lands in the replica's placement group:
one GPU each, `serve_graph.builder.policy_options`). Each model call is sent to rank 1 as an actor call with the
same batch, and both ranks then run `generate` in lock-step over their process group (`dreamzero.pipeline.
cfg_parallel`). `CfgPeer` is rank 0's side: start and join the actor, run a call on both ranks, and say when the
pair can no longer serve (rank 1 dead, an exchange failed or timed out), which makes the replica unhealthy so that
Serve replaces it; the replica's sessions then restart, flagged, on the replacement.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray

from dreamzero.errors import ConfigError, InvalidRequest, NotReady

log = logging.getLogger("dreamzero.serve.cfg_rank")

#: rank 1 loads its model while rank 0 loads its own; a load longer than this (a cold 14B read) fails the replica
LOAD_TIMEOUT_S = 1800.0
#: a rank 1 ping unanswered for this long (its actor runs pings beside the model call) means it is gone
PING_LIMIT_S = 30.0


def out_of_step(exc: BaseException, exchanged: bool) -> bool:
    """Whether a rank that failed a call with `exc` left the other one waiting: everything but bad input raised
    before the call's first exchange (input checks run on both ranks alike, before any exchange)."""
    return exchanged or not isinstance(exc, InvalidRequest)


def same_node(actor_options: dict[str, Any]) -> dict[str, Any]:
    """Rank 1's actor options: on GPU the replica's placement group (Serve's, which captures the replica's actors)
    keeps it on the node; on CPU there is none, so it is pinned to this node (the pair exchanges every step)."""
    if actor_options.get("num_gpus") or not ray.is_initialized():
        return dict(actor_options)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return {**actor_options, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}


def node_address() -> str:
    """This node's address as the other rank reaches it (rank 1 runs on the same node: placement or CPU)."""
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests): the loopback is the same machine
        return "127.0.0.1"


class CfgRank:
    """Rank 1 of a CFG-parallel Policy replica (wrapped as a Ray actor by `CfgRankActor`)."""

    def __init__(self, load_kwargs: dict, host: str, port: int, timeout_s: float):
        from dreamzero.pipeline import DreamZeroPipeline
        from dreamzero.pipeline.cfg_parallel import tcp_store

        t0 = time.perf_counter()
        self.timeout_s = timeout_s
        self._store = tcp_store(host, port, 1, timeout_s)
        self.pipeline = DreamZeroPipeline.load(**load_kwargs)
        self.threads: int | None = None
        log.info("CFG rank 1 loaded in %.1f s (pid %d)", time.perf_counter() - t0, os.getpid())

    def join(self, max_sessions: int) -> bool:
        """Build the process group and make its warm exchange with rank 0 (blocks until rank 0 builds its half,
        bounded by the timeout; PeerLost fails this call, and with it rank 0's `CfgPeer.join`)."""
        from dreamzero.pipeline.cfg_parallel import BranchGroup
        from dreamzero.sessions import SessionStore

        # no limits of its own: eviction, TTL and bytes are rank 0's decisions, mirrored at every call
        self.pipeline.store = SessionStore(max_sessions=max_sessions)
        self.pipeline.branch_group = BranchGroup(self._store, 1, self.pipeline.device, self.timeout_s)
        self.pipeline._footprints.clear()  # one branch's bytes from now on
        return True

    def generate(self, batch, threads: int | None = None) -> int:
        """Run rank 1's half of one model call; returns the DiT steps it ran (its actions are rank 0's)."""
        if threads is not None and threads != self.threads:
            import torch

            torch.set_num_threads(threads)
            self.threads = threads
        group = self.pipeline.branch_group
        before = group.collectives
        try:
            return self.pipeline.generate(batch).dit_steps
        except Exception as exc:
            if not out_of_step(exc, group.collectives != before):
                raise  # bad input: rank 0 raised the same before any exchange; the pair is still in step
            # Rank 0 now waits in an exchange this rank will never join. Ending the process closes the group's
            # sockets, so rank 0 fails at once (a live process leaves it waiting out the whole timeout) and its
            # replica reports itself unhealthy.
            log.error("CFG rank 1 failed mid-call (%s: %s); leaving so that rank 0 fails now", type(exc).__name__, exc)
            self._leave()
            raise

    @staticmethod
    def _leave() -> None:
        os._exit(1)

    def ping(self) -> dict:
        group = getattr(self.pipeline, "branch_group", None)
        return {"pid": os.getpid(), "sessions": len(self.pipeline.store), "broken": getattr(group, "broken", None)}


# threaded (2): a ping is answered while a model call runs; rank 0 never sends two model calls at once
CfgRankActor = ray.remote(max_concurrency=2, max_restarts=0)(CfgRank)


class CfgPeer:
    """Rank 0's side of the pair: starts rank 1, joins the group, runs each call on both ranks, watches rank 1.

    Started before rank 0 loads its model (both load at once), joined after rank 0 is sized (`join`).
    """

    def __init__(self, load_kwargs: dict, timeout_s: float, actor_options: dict[str, Any]):
        from dreamzero.pipeline.cfg_parallel import tcp_store

        self.timeout_s = timeout_s
        host = node_address()
        self._store = tcp_store(host, 0, 0, timeout_s)  # any free port; rank 1 is told which
        self.actor = CfgRankActor.options(**same_node(actor_options)).remote(
            load_kwargs, host, self._store.port, timeout_s
        )
        self.group = None
        self.pipeline = None
        self.rank1: dict = {}
        self._ping_ref = None
        self._ping_sent = 0.0
        self.problem: str | None = None

    def join(self, pipeline, max_sessions: int, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        """Wait for rank 1's model (bounded), then build the process group on both ranks and attach it. Building it
        makes the pair's one warm exchange (`BranchGroup.warm_up`: NCCL's communicator is created here), so an init
        failure raises from this call and fails the replica's start, never a robot's request."""
        from dreamzero.pipeline.cfg_parallel import BranchGroup

        try:
            if not pipeline.guided:
                raise ConfigError("policy.cfg_parallel: 2 needs classifier-free guidance (pipeline.cfg_scale != 1)")
            self.rank1 = ray.get(self.actor.ping.remote(), timeout=load_timeout_s)  # rank 1 has loaded
            joined = self.actor.join.remote(max_sessions)
            self.group = BranchGroup(self._store, 0, pipeline.device, self.timeout_s)
            ray.get(joined, timeout=self.timeout_s)
        except Exception:
            ray.kill(self.actor, no_restart=True)
            raise
        pipeline.branch_group = self.group
        pipeline._footprints.clear()  # one branch's bytes from now on
        self.pipeline = pipeline
        log.info("CFG-parallel pair ready: rank 0 (cond) here, rank 1 (uncond) pid %s", self.rank1.get("pid"))

    def run(self, generate: Callable[[], Any], batch, threads: int | None = None):
        """One model call on both ranks: rank 1's half is sent first, rank 0's runs here; rank 1's outcome is awaited
        (bounded) so that a failure on either side is this call's error."""
        self._check()
        ref = self.actor.generate.remote(batch, threads)
        from dreamzero.pipeline.cfg_parallel import PeerLost

        waited = self.group.wait_s
        try:
            result = generate()
        except Exception as exc:
            # bad input raised on both ranks before any exchange, and a failure here after the last one, leave rank 1
            # done and the pair in step; anything else leaves rank 1 waiting in an exchange this rank will not join
            self._settle(ref, 5.0)
            if isinstance(exc, PeerLost):
                self._fail(str(exc))
            if self.problem is None:
                raise
            ray.kill(self.actor, no_restart=True)  # rather than let it wait out its timeout
            raise NotReady(f"this policy replica lost its CFG-parallel rank 1: {self.problem}") from exc
        self._settle(ref, self.timeout_s)
        if self.problem is not None:
            raise NotReady(f"CFG-parallel rank 1 failed this call: {self.problem}")
        # the call's time in exchanges (transfers and waiting for rank 1): the reply's `model.cfg_exchange` timing
        # and the dreamzero_stage_latency_ms metric's stage of that name
        result.timings_ms = {**result.timings_ms, "cfg_exchange": (self.group.wait_s - waited) * 1000.0}
        return result

    def _settle(self, ref, timeout_s: float) -> None:
        try:
            ray.get(ref, timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self._fail(f"rank 1 did not finish the call: {type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - rank 1 raised what rank 0 raises (bad input) or a PeerLost
            pass
        if self.group.broken is not None:
            self._fail(self.group.broken)

    def _fail(self, why: str) -> None:
        if self.problem is None:
            log.error("CFG-parallel pair broken: %s", why)
        self.problem = self.problem or why

    def _check(self) -> None:
        if self.problem is not None:
            raise NotReady(f"this policy replica lost its CFG-parallel rank 1 and awaits replacement: {self.problem}")

    def health(self) -> str | None:
        """Why the pair cannot serve, or None. Never blocks: a ping is sent, and read at the next check."""
        if self.problem is None and self.group.broken is not None:
            self._fail(self.group.broken)
        if self.problem is None:
            if self._ping_ref is None:
                self._ping_ref, self._ping_sent = self.actor.ping.remote(), time.monotonic()
            else:
                ready, _ = ray.wait([self._ping_ref], timeout=0)
                if ready:
                    try:
                        self.rank1 = ray.get(self._ping_ref, timeout=1.0)
                        self._ping_ref = None
                    except Exception as exc:  # noqa: BLE001 - a dead actor answers its pings with its death
                        self._fail(f"rank 1 is gone: {type(exc).__name__}")
                elif time.monotonic() - self._ping_sent > PING_LIMIT_S:
                    self._fail(f"rank 1 has not answered a ping for {PING_LIMIT_S:g} s")
        return self.problem

    def topology(self, static: bool = False) -> dict:
        """The pair as GET /v1/models and the replica's stats report it (`static`: without the live counters)."""
        device = str(self.pipeline.device)
        out = {
            "cfg_parallel": 2,
            "ranks": [
                {"rank": 0, "branch": "cond", "device": device, "pid": os.getpid()},
                {"rank": 1, "branch": "uncond", "device": device, "pid": self.rank1.get("pid")},
            ],
        }
        if not static:
            out.update(exchanges=self.group.exchanges, exchanged_bytes=self.group.exchanged_bytes, problem=self.problem)
        return out

    def close(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self.group is not None:
            self.group.close()
