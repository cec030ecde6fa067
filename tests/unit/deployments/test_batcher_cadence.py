"""deployments.batcher foresees a robot's next request (docs/fleet.md "Scheduling"): a batch call that would still
run when a robot's request is due, so late that the robot's own call would end after its budget, waits for the
robot; a robot that does not come is waited for a bounded time only; a batch request owed its floor starts anyway;
with classes off the farm runs at once (first come, first served).

Items are tuples (name, class, deadline, rows, session) as in test_batcher_classes.py. The cost model is given
(`call_ms`: 100 ms per row, so the 8-row farm's call is predicted at 800 ms against the robot's 300 ms budget); the
calls themselves return at once, so what is checked is the order the rules give, on the real clock."""

from __future__ import annotations

import asyncio
import time

from deployments.batcher import HOLD_GRACE, ContinuousBatcher

CADENCE_S, BUDGET_S = 0.5, 0.3  # the robot asks every 0.5 s; its chunk runs out 0.3 s after it asks


def item(name, cls="realtime", deadline=None, rows=1, session="robot"):
    return (name, cls, deadline, rows, session)


def robot(name: str):
    return item(name, deadline=time.time() + BUDGET_S)


def farm():
    return item("farm", "batch", rows=8, session="farm")


async def fleet(robot_comes: bool, classes: bool = True, starved: int = 0) -> tuple[list[str], float, dict]:
    """A robot that asked twice, CADENCE_S apart; right after its second chunk a farm request queues; the robot's
    third request comes when due (or never). Returns the calls' names in order, when the third request was due, and
    when each call started."""
    calls: list[str] = []
    started: dict[str, float] = {}

    async def run(batch):
        names = "+".join(it[0] for it in batch)
        calls.append(names)
        started[names] = time.time()
        return batch

    batcher = ContinuousBatcher(
        run, max_batch_size=8, wait_s=0.0, rows_of=lambda it: it[3], class_of=lambda it: it[1],
        deadline_of=lambda it: it[2], sessions_of=lambda it: [it[4]], call_ms=lambda rows: 100.0 * rows,
        floor_calls=4, clock=time.time,
    )  # fmt: skip
    batcher.classes = classes
    await asyncio.wait_for(batcher.submit(item("r0")), 5)  # a robot's first query states no budget
    await asyncio.sleep(CADENCE_S)
    await asyncio.wait_for(batcher.submit(robot("r1")), 5)
    due = time.time() + CADENCE_S  # about when r2 comes (r1 was noted just before)
    batcher.batch_starved = starved
    farm_task = asyncio.create_task(batcher.submit(farm()))
    if robot_comes:
        await asyncio.sleep(max(0.0, due - time.time()))
        await asyncio.wait_for(batcher.submit(robot("r2")), 5)
    await asyncio.wait_for(farm_task, 5)
    return calls, due, started


def test_a_batch_call_that_would_make_the_robot_late_waits_for_it():
    calls, _, _ = asyncio.run(fleet(robot_comes=True))
    # the farm's 800 ms call started now would still run when r2 comes: r2 goes first (the farm's rows do not join
    # it either: r2 + farm would end after r2's deadline), then the farm
    assert calls == ["r0", "r1", "r2", "farm"]


def test_classes_off_the_farm_runs_at_once():
    calls, _, _ = asyncio.run(fleet(robot_comes=True, classes=False))
    assert calls == ["r0", "r1", "farm", "r2"]


def test_a_robot_that_does_not_come_is_waited_for_a_bounded_time():
    calls, due, started = asyncio.run(fleet(robot_comes=False))
    assert calls == ["r0", "r1", "farm"]
    # held until the robot was due, at most its grace past that (plus the scheduling of this loop)
    assert due - 0.05 <= started["farm"] <= due + HOLD_GRACE * CADENCE_S + 1.0


def test_a_batch_request_owed_its_floor_starts_anyway():
    calls, due, started = asyncio.run(fleet(robot_comes=True, starved=4))
    assert calls == ["r0", "r1", "farm", "r2"]
    assert started["farm"] < due - 0.2  # not held for the robot
