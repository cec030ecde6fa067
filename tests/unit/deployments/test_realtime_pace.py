"""deployments.admission's realtime pace (docs/fleet.md "Scheduling"): the replica's cost per row, fitted from its
model calls, refuses a new realtime session that would push the admitted ones past the tightest budget they state
(503 + Retry-After, naming the numbers); batch rows, sessions already admitted, and traffic that states no budget
are never refused for pace, and nothing is refused before enough calls are measured."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from deployments.admission import PACE_MIN_CALLS, Admission, CallCost, RealtimePace
from dreamzero.errors import CapacityError
from dreamzero.types import ModelBatch


def batch(ids, cls=None, deadline_ms=None) -> ModelBatch:
    n = len(ids)
    now = time.time()
    return ModelBatch(
        images=np.zeros((n, 1, 2, 2, 3), np.uint8),
        state=np.zeros((n, 1, 64), np.float32),
        state_mask=np.ones((n, 1, 64), bool),
        prompts=["p"] * n,
        session_ids=list(ids),
        traffic_class=None if cls is None else [cls] * n,
        deadline_at=None if deadline_ms is None else [now + deadline_ms / 1000.0] * n,
    )


def measured(a_ms=20.0, b_ms=10.0, sizes=(1, 2, 4, 8)) -> CallCost:
    cost = CallCost()
    for i in range(PACE_MIN_CALLS):
        rows = sizes[i % len(sizes)]
        cost.add(rows, a_ms + b_ms * rows)
    return cost


def test_cost_is_fitted_per_row_and_unknown_until_enough_calls():
    cost = CallCost()
    for _ in range(PACE_MIN_CALLS - 1):
        cost.add(4, 60.0)
    assert cost.predict(4) is None
    cost.add(4, 60.0)
    # one size measured: its cost, scaled up in proportion above it, never below it
    assert cost.predict(2) == pytest.approx(60.0) and cost.predict(8) == pytest.approx(120.0)
    fitted = measured(20.0, 10.0)
    assert fitted.predict(1) == pytest.approx(30.0) and fitted.predict(16) == pytest.approx(180.0)


def test_a_new_realtime_session_past_the_pace_is_refused_naming_the_numbers():
    pace = RealtimePace(measured(20.0, 10.0), retry_after_s=2.0)  # a call of n rows: 20 + 10 n ms
    for i in range(4):  # 4 robots, 105 ms of buffer each: a call of 4 rows (60 ms) keeps them at pace
        pace.check(batch([f"robot{i}"], "realtime", deadline_ms=105))
    assert pace.admitted() == 4
    for i in range(4, 8):
        pace.check(batch([f"robot{i}"], "realtime", deadline_ms=105))  # 8 rows: 100 ms
    with pytest.raises(CapacityError) as info:
        pace.check(batch(["robot8"], "realtime", deadline_ms=105))  # 9 rows: 110 ms > 105 ms
    msg = str(info.value)
    assert "realtime sessions at pace: 8" in msg and "predicted at 110 ms > deadline" in msg
    assert info.value.retry_after_s == 2.0 and pace.admitted() == 8
    # an admitted robot keeps being served; a farm's batch rows queue; a robot that leaves frees its place
    pace.check(batch(["robot3"], "realtime", deadline_ms=105))
    pace.check(batch([f"env{i}" for i in range(16)], "batch", deadline_ms=105))
    pace.forget(["robot0"])
    pace.check(batch(["robot8"], "realtime", deadline_ms=105))
    assert pace.admitted() == 8


def test_no_budget_no_measurements_or_off_means_no_pace_check():
    many = [f"r{i}" for i in range(64)]
    RealtimePace(measured(), 1.0).check(batch(many, "realtime"))  # no deadline stated anywhere
    RealtimePace(measured(), 1.0).check(batch(many, "realtime", deadline_ms=0))  # an empty buffer states no budget
    RealtimePace(CallCost(), 1.0).check(batch(many, "realtime", deadline_ms=10))  # nothing measured yet
    off = RealtimePace(measured(), 1.0)
    off.enabled = False  # batching.realtime_admission: false
    off.check(batch(many, "realtime", deadline_ms=10))
    assert off.admitted() == 64
    with pytest.raises(CapacityError):
        RealtimePace(measured(), 1.0).check(batch(many, None, deadline_ms=10))  # no class stated: realtime


class _Engine:
    max_batch_rows = 64


class _Counter:
    def __init__(self):
        self.n = 0

    def inc(self, n=1, tags=None):
        self.n += n


class _Metrics:
    def __init__(self):
        self.realtime_refusals = _Counter()


def test_admission_refuses_at_entry_and_counts_it():
    metrics = _Metrics()
    admission = Admission(_Engine(), metrics, "r", None, None, retry_after_s=3.0)
    for i in range(PACE_MIN_CALLS):
        admission.cost.add(1 + i % 4, 50.0 + 50.0 * (1 + i % 4))
    asyncio.run(admission.enter(batch(["a"], "realtime", deadline_ms=150), None))  # 100 ms: at pace
    with pytest.raises(CapacityError, match="realtime sessions at pace: 1"):
        asyncio.run(admission.enter(batch(["b"], "realtime", deadline_ms=150), None))  # 150 ms: not under 150
    assert metrics.realtime_refusals.n == 1
    asyncio.run(admission.enter(batch(["farm"], "batch", deadline_ms=150), None))


def test_the_scheduling_knobs_are_live_and_refused_when_bad():
    from types import SimpleNamespace

    from deployments.batcher import ContinuousBatcher
    from deployments.config.settings import PolicySettings
    from deployments.live_tuning import apply_live_tuning, parse_live_tuning
    from dreamzero.errors import ConfigError

    settings = PolicySettings()
    store = SimpleNamespace(ttl_s=None, max_sessions=None)
    replica = SimpleNamespace(
        settings=settings,
        engine=SimpleNamespace(pipeline=SimpleNamespace(), store=store, cfg_parallel=1),
        start_loop=None,
        batcher=ContinuousBatcher(lambda b: b, 8, 0.0, class_of=lambda it: "batch"),
        admission=Admission(_Engine(), _Metrics(), "r", None, None),
    )
    live = {"batching": {"traffic_classes": False, "batch_floor_calls": 2, "realtime_admission": False}}
    effect = apply_live_tuning(replica, parse_live_tuning(live))
    assert (replica.batcher.classes, replica.batcher.floor_calls, replica.admission.pace.enabled) == (False, 2, False)
    assert effect["batching"]["traffic_classes"] is False
    apply_live_tuning(replica, parse_live_tuning({}))  # the args values again: the defaults
    assert (replica.batcher.classes, replica.batcher.floor_calls, replica.admission.pace.enabled) == (True, 4, True)
    with pytest.raises(ConfigError, match="user_config.batching.batch_floor_calls"):
        parse_live_tuning({"batching": {"batch_floor_calls": 0}})
