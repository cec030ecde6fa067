"""deployments.batcher with traffic classes (docs/fleet.md "Scheduling"): realtime requests fill a call first, earliest
deadline first, batch requests get the rest and a floor, a realtime request never waits for batch company, a
session's requests keep their arrival order, and with classes off the batcher is first come, first served.

Items are tuples (name, class, deadline, rows, session); a blocker holds the model while the scenario queues, so
every call's content is decided by the rules, not by timing."""

from __future__ import annotations

import asyncio

from deployments.batcher import ContinuousBatcher

NOW = 1000.0  # the fake wall clock deadlines are stated on


def item(name, cls="realtime", deadline=None, rows=1, session=None):
    return (name, cls, deadline, rows, session or name)


def make(run, **kw) -> ContinuousBatcher:
    options = dict(
        max_batch_size=8,
        wait_s=0.0,
        rows_of=lambda it: it[3],
        class_of=lambda it: it[1],
        deadline_of=lambda it: it[2],
        sessions_of=lambda it: [it[4]],
        clock=lambda: NOW,
    )
    return ContinuousBatcher(run, **{**options, **kw})


def scenario(items, classes: bool = True, **kw) -> list[list[str]]:
    """The names of each call's items when `items` queue while a blocker holds the model."""
    calls: list[list[str]] = []

    async def main():
        gate = asyncio.Event()

        async def run(batch):
            calls.append([it[0] for it in batch])
            if batch[0][0] == "blocker":
                await gate.wait()
            return batch

        batcher = make(run, **kw)
        batcher.classes = classes  # the live knob `batching.traffic_classes`
        blocker = asyncio.create_task(batcher.submit(item("blocker")))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(batcher.submit(it)) for it in items]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(asyncio.gather(blocker, *tasks), 10)

    asyncio.run(main())
    return calls[1:]


def test_realtime_first_by_deadline_then_batch_in_arrival_order():
    items = [
        item("b1", "batch", rows=3),
        item("r-none", "realtime"),
        item("r-late", "realtime", NOW + 5),
        item("b2", "batch", rows=3),
        item("r-soon", "realtime", NOW + 1),
    ]
    # 3 realtime rows + b1 = 6 fit, b2 does not: it waits for the next call
    calls = scenario(items, max_batch_rows=6)
    # each call's items are handed over in arrival order, whatever order chose them
    assert calls == [["b1", "r-none", "r-late", "r-soon"], ["b2"]]
    # the order matters when realtime alone fills the call: the earliest deadlines go first, no-deadline after
    calls = scenario(items, max_batch_size=2)
    assert calls == [["r-late", "r-soon"], ["b1", "r-none"], ["b2"]]


def test_classes_off_is_first_come_first_served():
    items = [item("b1", "batch", rows=3), item("r1", "realtime", NOW + 1), item("b2", "batch", rows=3)]
    assert scenario(items, classes=False, max_batch_size=1) == [["b1"], ["r1"], ["b2"]]
    assert scenario(items, classes=True, max_batch_size=1) == [["r1"], ["b1"], ["b2"]]
    # off, the first request that does not fit ends the call, whatever its class (today's rule)
    assert scenario(items, classes=False, max_batch_rows=4) == [["b1", "r1"], ["b2"]]


def test_batch_is_never_starved_a_floor_of_calls():
    """Realtime requests that alone fill every call: after `floor_calls` calls without a batch row, the oldest batch
    request goes first."""
    calls: list[list[str]] = []

    async def main():
        batcher_box = {}

        async def run(batch):
            calls.append([it[0] for it in batch])
            # each realtime client comes straight back while the call runs (a saturating fleet of robots)
            for it in batch:
                if it[1] == "realtime" and len(calls) < 12:
                    name = f"{it[4]}.{len(calls)}"
                    tasks.append(asyncio.create_task(batcher_box["b"].submit(item(name, session=it[4]))))
            await asyncio.sleep(0)
            return batch

        batcher = batcher_box["b"] = make(run, max_batch_rows=2, floor_calls=3)
        # all three queue before the worker's first call
        tasks = [asyncio.create_task(batcher.submit(item(n, session=n))) for n in ("x", "y")]
        tasks.append(asyncio.create_task(batcher.submit(item("farm", "batch", rows=2))))
        while not all(t.done() for t in tasks):
            await asyncio.wait_for(asyncio.gather(*tasks), 10)

    asyncio.run(main())
    farm_call = next(i for i, c in enumerate(calls) if "farm" in c)
    # calls 0, 1, 2 (the realtime pair) pass the farm over; the fourth call is the farm's
    assert farm_call == 3 and calls[farm_call] == ["farm"]
    assert all(len(c) == 2 and "farm" not in c for c in calls[:3])


def test_batch_does_not_join_a_call_it_would_make_miss_a_realtime_deadline():
    def cost(rows):  # 100 ms per row
        return 100.0 * rows

    items = [item("b1", "batch", rows=4), item("r1", "realtime", NOW + 0.25), item("b2", "batch", rows=1)]
    # r1 alone (100 ms) meets its 250 ms; with b1 (500 ms) it would not; b2 waits behind b1 (arrival order)
    assert scenario(items, call_ms=cost) == [["r1"], ["b1", "b2"]]
    # no deadline stated, or no measured cost yet: batch rows fill the call
    undated = [item("b1", "batch", rows=4), item("r1", "realtime"), item("b2", "batch", rows=1)]
    assert scenario(undated, call_ms=cost) == [["b1", "r1", "b2"]]
    assert scenario(items, call_ms=lambda rows: None) == [["b1", "r1", "b2"]]


def test_a_sessions_requests_keep_their_arrival_order():
    # s's second request is realtime with an early deadline, its first is batch: the second never overtakes it
    items = [item("s-1", "batch", session="s"), item("r", "realtime"), item("s-2", "realtime", NOW + 1, session="s")]
    # s-2 is passed over (its session waits for s-1); r and s-1 fill the call
    assert scenario(items, max_batch_size=2) == [["s-1", "r"], ["s-2"]]


def test_a_realtime_request_never_waits_for_batch_company():
    """The previous call held a robot and a farm request; the farm's next request is not back yet. The robot's
    request runs without waiting `wait_s` (an hour here) for it; with classes off it would wait."""
    calls: list[list[str]] = []

    async def main():
        async def run(batch):
            calls.append([it[0] for it in batch])
            return batch

        batcher = make(run, wait_s=3600.0)
        first = [batcher.submit(item("robot.0")), batcher.submit(item("farm.0", "batch", rows=4))]
        await asyncio.wait_for(asyncio.gather(*first), 10)
        assert batcher.expected == 2 and batcher.expected_realtime == 1
        await asyncio.wait_for(batcher.submit(item("robot.1", session="robot.0")), 10)

    asyncio.run(main())
    assert calls == [["robot.0", "farm.0"], ["robot.1"]]
