"""The Policy replica's parts (deployments.engine, admission, replica_report): each engine is built by its own
constructor with the replica's session store, the CFG-parallel pair's wiring (rank 1 started before rank 0 loads,
joined after sizing, closed when the start fails), and the replica answering through its parts. Fakes stand in for
the model and for rank 1 (their real paths: tests/unit/pipeline/test_cfg_parallel.py,
tests/e2e/test_cfg_parallel_serve.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import deployments.engine as engine_mod
from deployments.config.settings import PolicySettings
from deployments.engine import CfgPairEngine, ModelEngine, StoreOptions, load_engine
from deployments.policy import PolicyDeployment
from deployments.tenants import scoped_id, tenant_of
from dreamzero.config import preset
from dreamzero.errors import NotReady
from dreamzero.sessions import SessionStore
from dreamzero.types import ChunkResult, ModelBatch, SessionReport


class FakePipeline:
    """The pipeline interface the engines use, with the store it was given (or its own, as a loaded one has)."""

    def __init__(self, store: SessionStore | None = None):
        self.action_horizon, self.max_action_dim = 24, 32
        self.config, self.device, self.guided = preset("tiny").pipeline, torch.device("cpu"), True
        self.store = store if store is not None else SessionStore()
        self.calls: list[tuple[list[str], bool]] = []

    def admit(self, batch, busy=()):
        self.store.admit({sid: 0 for sid in batch.session_ids}, busy)

    def generate(self, batch, return_latents=False):
        self.calls.append((list(batch.session_ids), return_latents))
        reports = [SessionReport(s, 1, True, "new_session", 1) for s in batch.session_ids]
        return ChunkResult(actions=np.zeros((len(batch), 24, 32), np.float32), sessions=reports)

    def stats(self):
        return self.store.stats()


class FakePeer:
    """Rank 1's side as `CfgPairEngine` drives it; `events` keeps the order of what happened to it and to rank 0."""

    events: list = []
    problem: str | None = None
    fail_join = False

    def __init__(self, load_kwargs, timeout_s, actor_options):
        FakePeer.events.append(("peer started", dict(load_kwargs)))
        self.closed = False

    def join(self, pipeline, max_sessions):
        if FakePeer.fail_join:
            raise RuntimeError("rank 1 never loaded")
        FakePeer.events.append(("joined", max_sessions))

    def run(self, generate, batch, threads):
        FakePeer.events.append(("both ranks", list(batch.session_ids)))
        return generate()

    def health(self):
        return FakePeer.problem

    def topology(self, static=False):
        return {"cfg_parallel": 2, "static": static}

    def close(self):
        FakePeer.events.append(("closed", None))


def _batch(ids: list[str]) -> ModelBatch:
    b = len(ids)
    return ModelBatch(
        images=np.zeros((b, 1, 8, 8, 3), np.uint8),
        state=np.zeros((b, 1, 64), np.float32),
        state_mask=np.zeros((b, 1, 64), bool),
        prompts=["p"] * b,
        session_ids=ids,
    )


@pytest.fixture
def fakes(monkeypatch):
    import deployments.cfg_rank as cfg_rank

    loaded: list[dict] = []

    def load_pipeline(store=None, **kwargs):
        loaded.append(kwargs)
        FakePeer.events.append(("rank 0 loaded", None))
        return FakePipeline(store)

    FakePeer.events, FakePeer.problem, FakePeer.fail_join = [], None, False
    monkeypatch.setattr(engine_mod, "load_pipeline", load_pipeline)
    monkeypatch.setattr(engine_mod, "replica_plan", lambda s: None)  # a plain CPU plans nothing
    monkeypatch.setattr(cfg_rank, "CfgPeer", FakePeer)
    return loaded


def _settings(**kw) -> PolicySettings:
    return PolicySettings(batching={"max_batch_rows": 3}, sessions={"max_sessions": 5}, **kw)


def test_the_model_engine_builds_its_store_with_the_replicas_options(fakes):
    evicted = []
    options = StoreOptions(
        group_of=tenant_of, on_evict=lambda sid, cause: evicted.append((sid, cause)), retry_after_s=7
    )
    engine = load_engine(_settings(), options)
    store = engine.store
    assert type(engine) is ModelEngine and engine.cfg_parallel == 1 and engine.max_batch_rows == 3
    assert (store.max_sessions, store.retry_after_s, store.group_of) == (5, 7, tenant_of)
    first, second = scoped_id("team-a", "s1"), scoped_id("team-a", "s2")
    store.max_sessions = 1
    store.put(_state(first))
    store.put(_state(second))
    # the store's constructor wired the hooks: no attribute was set on it after it was built
    assert evicted == [(first, "lru")] and store.group_counts() == {"team-a": 1}


def _state(sid: str):
    from dreamzero.sessions import SessionState

    return SessionState(session_id=sid, prompt="p", negative_prompt="")


def test_the_cfg_pair_starts_rank_1_first_joins_after_sizing_and_runs_every_call_on_both(fakes):
    engine = load_engine(_settings(cfg_parallel=2), StoreOptions())
    assert type(engine) is CfgPairEngine and engine.cfg_parallel == 2
    started, loaded = FakePeer.events[0], FakePeer.events[1]
    assert started[0] == "peer started" and loaded[0] == "rank 0 loaded"
    assert started[1] == fakes[0]  # rank 1 loads what rank 0 loads (rank 0 alone gets the replica's store)
    assert FakePeer.events[2] == ("joined", 5 + 2 * 3)  # sessions plus two batches of scratch rows
    assert engine.memory["topology"] == {"cfg_parallel": 2, "static": True}
    engine.generate(_batch(["x"]), return_latents=True)
    assert FakePeer.events[-1] == ("both ranks", ["x"]) and engine.pipeline.calls == [(["x"], True)]
    assert engine.stats()["topology"] == {"cfg_parallel": 2, "static": False} and engine.health() is None
    FakePeer.problem = "rank 1 is gone"
    assert engine.health() == "rank 1 is gone"
    engine.close()
    assert FakePeer.events[-1] == ("closed", None)


def test_a_cfg_pair_that_fails_to_start_closes_rank_1(fakes):
    FakePeer.fail_join = True
    with pytest.raises(RuntimeError, match="rank 1 never loaded"):
        load_engine(_settings(cfg_parallel=2), StoreOptions())
    assert FakePeer.events[-1] == ("closed", None)


def test_the_replica_answers_and_reports_through_its_parts(fakes):
    FakePeer.problem = None
    policy = PolicyDeployment(_settings(cfg_parallel=2))
    assert policy.engine.store.group_of is tenant_of  # the replica's tenants, given to the store's constructor
    out = asyncio.run(policy.generate(_batch(["a", "b"])))
    assert [s.session_id for s in out.result.sessions] == ["a", "b"] and out.replica == policy.replica
    assert policy.info()["cfg_parallel"] == 2 and policy.info()["max_batch_rows"] == 3
    assert policy.stats()["live"] == 0 and policy.stats()["topology"]["cfg_parallel"] == 2
    assert policy.ready() is True
    FakePeer.problem = "rank 1 has not answered a ping for 30 s"
    with pytest.raises(NotReady, match="rank 1 has not answered a ping"):
        policy.ready()
    with pytest.raises(RuntimeError, match="rank 1 has not answered a ping"):
        policy.check_health()
    FakePeer.problem = None
    policy.__del__()
    assert FakePeer.events[-1] == ("closed", None)
