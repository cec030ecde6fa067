"""`PolicyDeployment.ready()` (what the ingress's /health asks every deployment) and `check_health()` (what Serve
polls to replace a replica) say whether the replica can serve: True when idle or computing in time; NotReady /
an error naming the cause when a model call is stuck on the model thread past `STUCK_CALL_S`, or no pipeline is
loaded. In-process, the real Policy replica class over the embedded tiny model (no Ray)."""

from __future__ import annotations

import asyncio
import threading

import pytest

import deployments.replica_report as report_module
from deployments.config.settings import PolicySettings
from deployments.policy import PolicyDeployment
from dreamzero.errors import NotReady
from dreamzero.pipeline.budget import warmup_batch, warmup_canvas_hw


@pytest.fixture(scope="module")
def policy():
    fast = {"num_inference_steps": 2, "dit_step_mask": None}  # the question is readiness, not the chunk
    return PolicyDeployment(PolicySettings(pipeline=fast))


def ask_during_a_call(policy, monkeypatch, wait_s: float, ask) -> None:
    """Run one chunk whose model call holds the model thread until `ask()` (called `wait_s` after the call started
    on that thread) has returned; then let it finish and drop its session."""
    release, started = threading.Event(), threading.Event()
    real_generate = policy.pipeline.generate

    def held_generate(*args, **kwargs):
        started.set()
        release.wait(30)  # bounded: released as soon as the question was asked
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(policy.pipeline, "generate", held_generate)
    batch = warmup_batch(policy.pipeline, 1, warmup_canvas_hw(policy.pipeline))

    async def run():
        task = asyncio.create_task(policy.generate(batch))
        try:
            for _ in range(3000):  # 30 s at most
                if started.is_set():
                    break
                await asyncio.sleep(0.01)
            assert started.is_set(), "the model call never started"
            await asyncio.sleep(wait_s)
            ask()
        finally:
            release.set()
        await task
        await policy.drop_sessions(batch.session_ids)

    try:
        asyncio.run(run())
    finally:
        release.set()
        monkeypatch.setattr(policy.pipeline, "generate", real_generate)


def test_ready_while_idle_and_while_a_call_runs_in_time(policy, monkeypatch):
    assert policy.ready() is True
    policy.check_health()
    answers = []
    ask_during_a_call(policy, monkeypatch, 0.3, lambda: answers.append((policy.ready(), policy.check_health())))
    assert answers == [(True, None)]  # a busy replica within STUCK_CALL_S is a ready one


def test_a_stuck_model_call_makes_the_replica_unready_until_it_returns(policy, monkeypatch):
    monkeypatch.setattr(report_module, "STUCK_CALL_S", 0.2)
    seen = []

    def ask():
        with pytest.raises(NotReady, match=r"a model call has been running for \d+ s \(limit 0.2 s\)") as info:
            policy.ready()
        seen.append(str(info.value))
        with pytest.raises(RuntimeError, match="a model call has been running"):
            policy.check_health()  # Serve replaces the replica

    ask_during_a_call(policy, monkeypatch, 0.5, ask)
    assert len(seen) == 1 and seen[0].startswith(f"policy replica {policy.replica}: ")
    assert policy.ready() is True  # the call returned: ready again
    policy.check_health()


def test_a_replica_without_a_pipeline_is_not_ready(policy, monkeypatch):
    monkeypatch.setattr(policy.engine, "pipeline", None)
    with pytest.raises(NotReady, match="the model pipeline is not loaded"):
        policy.ready()
    with pytest.raises(RuntimeError, match="the model pipeline is not loaded"):
        policy.check_health()
