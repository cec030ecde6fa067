"""The Policy replica's traffic per class (docs/fleet.md "Scheduling"): every model call feeds the cost model the
realtime admission and the batcher read, and `stats()` counts per class the requests, rows and deadline misses (a
realtime row whose result was ready after its deadline). A fake pipeline stands in for the model."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import deployments.engine as engine_mod
from deployments.config.settings import PolicySettings
from deployments.policy import PolicyDeployment
from dreamzero.config import preset
from dreamzero.sessions import SessionStore
from dreamzero.types import ChunkResult, ModelBatch, SessionReport


class FakePipeline:
    def __init__(self, store: SessionStore | None = None):
        self.action_horizon, self.max_action_dim = 24, 32
        self.config, self.device, self.guided = preset("tiny").pipeline, torch.device("cpu"), True
        self.store = store if store is not None else SessionStore()

    def admit(self, batch, busy=()):
        self.store.admit({sid: 0 for sid in batch.session_ids}, busy)

    def generate(self, batch, return_latents=False):
        reports = [SessionReport(s, 1, True, "new_session", 1) for s in batch.session_ids]
        return ChunkResult(actions=np.zeros((len(batch), 24, 32), np.float32), sessions=reports)

    def stats(self):
        return self.store.stats()


@pytest.fixture
def policy(monkeypatch):
    monkeypatch.setattr(engine_mod, "load_pipeline", lambda store=None, **kw: FakePipeline(store))
    monkeypatch.setattr(engine_mod, "replica_plan", lambda s: None)
    return PolicyDeployment(PolicySettings(batching={"max_batch_rows": 16}, sessions={"max_sessions": 32}))


def batch(ids, cls, deadline_at=None) -> ModelBatch:
    n = len(ids)
    return ModelBatch(
        images=np.zeros((n, 1, 8, 8, 3), np.uint8),
        state=np.zeros((n, 1, 64), np.float32),
        state_mask=np.zeros((n, 1, 64), bool),
        prompts=["p"] * n,
        session_ids=list(ids),
        traffic_class=[cls] * n,
        deadline_at=None if deadline_at is None else [deadline_at] * n,
    )


def test_the_replica_counts_each_class_and_measures_its_calls(policy):
    late = time.time() - 1.0  # the robot's buffer ran out before its chunk was ready
    asyncio.run(policy.generate(batch(["robot"], "realtime", late)))
    asyncio.run(policy.generate(batch(["robot2"], "realtime", time.time() + 3600.0)))
    asyncio.run(policy.generate(batch([f"env{i}" for i in range(4)], "batch", late)))
    traffic = policy.stats()["traffic"]
    assert traffic["realtime"]["requests"] == 2 and traffic["realtime"]["rows"] == 2
    assert traffic["realtime"]["deadline_misses"] == 1
    # batch rows past a deadline they stated count under their own class, per row
    assert traffic["batch"] == {**traffic["batch"], "requests": 1, "rows": 4, "deadline_misses": 4}
    assert traffic["realtime_sessions"] == 2  # the farm's sessions never count at pace
    assert len(policy.admission.cost) == 3  # every model call measured
