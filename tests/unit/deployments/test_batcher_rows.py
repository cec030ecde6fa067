"""deployments.batcher bounds a batch in rows (a request of B sessions is B rows), never splitting a request."""

from __future__ import annotations

import asyncio

from deployments.batcher import ContinuousBatcher


def test_batches_are_bounded_in_rows_in_arrival_order():
    calls: list[list[str]] = []

    async def run(items):
        calls.append(list(items))
        await asyncio.sleep(0.01)
        return items

    async def scenario():
        rows = {"a3": 3, "b2": 2, "c2": 2, "d1": 1, "e5": 5}
        batcher = ContinuousBatcher(run, max_batch_size=8, wait_s=0.0, rows_of=rows.__getitem__, max_batch_rows=4)
        blocker = asyncio.create_task(batcher.submit("d1"))  # holds the model while the rest queue
        await asyncio.sleep(0)
        out = await asyncio.gather(*(batcher.submit(x) for x in ("a3", "b2", "c2", "e5")))
        await blocker
        return out

    assert asyncio.run(scenario()) == ["a3", "b2", "c2", "e5"]
    # a3 + b2 = 5 rows > 4: b2 waits; b2 + c2 = 4 fit; e5 alone (over the bound: the policy refuses such requests)
    assert calls == [["d1"], ["a3"], ["b2", "c2"], ["e5"]]
    assert all(sum(int(x[1]) for x in c) <= 4 for c in calls[:-1])


def test_queued_items_are_visible_for_admission():
    async def scenario():
        gate = asyncio.Event()

        async def run(items):
            await gate.wait()
            return items

        batcher = ContinuousBatcher(run, max_batch_size=1, wait_s=0.0)
        first = asyncio.create_task(batcher.submit("x"))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(batcher.submit("y"))
        await asyncio.sleep(0.01)
        queued = batcher.queued()
        gate.set()
        await asyncio.gather(first, second)
        return queued

    assert asyncio.run(scenario()) == ["y"]
