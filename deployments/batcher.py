"""Continuous dynamic batching for the policy replica: a batch is formed when the model becomes free.

`@serve.batch` forms a batch as soon as its window closes, even while the previous batch still holds the model; the
formed batch then waits, frozen, and requests arriving meanwhile start another one. With closed-loop clients (a robot
sends its next observation as soon as it has its actions) that splits N clients into alternating half-size batches
for good. Here requests queue while the model runs and the next batch takes everything queued the moment it is free.

When the model is free and fewer requests are queued than were active during the previous batch (the requests it
held, whose clients are on their way back, plus those that queued while it ran), the batch waits for them, at most
`wait_s`. A lone client therefore never waits, N closed-loop clients are served as one batch of N (two cohorts that
got split merge again after one call), and when a client leaves one batch waits the full `wait_s` before the
expectation follows the new count.

Items for which `wants_company(item)` is true (the policy: requests that start a session) wait up to `wait_s` for a
full batch even when no company is expected, as long as requests keep arriving (a gap of `COMPANY_GAP * wait_s`
ends the wait): clients that start together (parallel simulation environments, a fleet after a reset) then start in
one batch. That matters beyond their first call: a session restarts when its window is full, a fixed number of
chunks after it started, so sessions started apart keep their expensive restarts in different, smaller batches for
good. The price is `COMPANY_GAP * wait_s` on a lone session's first call.

A batch is bounded twice: at most `max_batch_size` requests and at most `max_batch_rows` rows (`rows_of(item)`: the
policy counts session rows, B per request; the model runs twice as many with classifier-free guidance). Requests are
taken in arrival order and never split; the first request that does not fit waits for the next batch. A request
larger than `max_batch_rows` must be refused before `submit` (the policy does); if one arrives anyway it runs alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger("dreamzero.serve.batcher")

#: a wait for sessions starting together ends when none arrived for this share of `wait_s`
COMPANY_GAP = 0.25

Item = TypeVar("Item")
Result = TypeVar("Result")


class ContinuousBatcher(Generic[Item, Result]):
    """`await submit(item)` -> that item's result from `run(list_of_items)`, one `run` at a time, in arrival order."""

    def __init__(
        self,
        run: Callable[[list[Item]], Awaitable[list[Result]]],
        max_batch_size: int,
        wait_s: float,
        wants_company: Callable[[Item], bool] | None = None,
        rows_of: Callable[[Item], int] | None = None,
        max_batch_rows: int | None = None,
    ):
        if max_batch_size < 1 or wait_s < 0:
            raise ValueError(f"max_batch_size must be >= 1 and wait_s >= 0, got {max_batch_size}, {wait_s}")
        if max_batch_rows is not None and max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1 or None, got {max_batch_rows}")
        self._run, self.max_batch_size, self.wait_s = run, max_batch_size, wait_s
        self._rows_of = rows_of or (lambda item: 1)
        self.max_batch_rows = max_batch_rows
        self._wants_company = wants_company
        self._queue: list[tuple[Item, asyncio.Future]] = []
        self._arrived: asyncio.Event | None = None  # created on the serving loop
        self._worker: asyncio.Task | None = None
        self.expected = 1  # requests active during the previous batch: the company the next one waits for

    async def submit(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._arrived = asyncio.Event()
            self._worker = loop.create_task(self._serve_forever())
        future = loop.create_future()
        self._queue.append((item, future))
        self._arrived.set()
        return await future

    def queued(self) -> list[Item]:
        """Items waiting for a batch (their sessions are busy: admission must not evict them)."""
        return [item for item, fut in self._queue if not fut.done()]

    def _queued_rows(self) -> int:
        return sum(self._rows_of(item) for item, fut in self._queue if not fut.done())

    def _take(self) -> list[tuple[Item, asyncio.Future]]:
        """The next batch: queued requests in arrival order while they fit both bounds (at least one)."""
        taken: list[tuple[Item, asyncio.Future]] = []
        rows, i = 0, 0
        while i < len(self._queue) and len(taken) < self.max_batch_size:
            item, fut = self._queue[i]
            if fut.done():  # its caller gave up
                i += 1
                continue
            n = self._rows_of(item)
            if taken and self.max_batch_rows is not None and rows + n > self.max_batch_rows:
                break
            taken.append((item, fut))
            rows += n
            i += 1
        self._queue = self._queue[i:]
        return taken

    def _target(self) -> tuple[int, float | None]:
        """How many queued requests the next batch waits for (at most `wait_s`), and the arrival gap that ends the
        wait early (None: only the deadline does)."""
        target = min(self.expected, self.max_batch_size)
        if target < self.max_batch_size and self._wants_company is not None:
            try:
                wanted = any(self._wants_company(item) for item, fut in self._queue if not fut.done())
            except Exception:  # a hint only: never let it stop the worker (and hang its callers)
                log.exception("wants_company failed; batching without the hint")
                wanted = False
            if wanted:
                return self.max_batch_size, self.wait_s * COMPANY_GAP
        return target, None

    async def _serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            # 1. the model is free: wait (bounded) for the clients of the previous batch to come back, and for
            #    sessions starting alongside a new one while they keep arriving
            deadline = loop.time() + self.wait_s
            informed = min(self.expected, self.max_batch_size)
            while True:
                target, gap = self._target()
                remaining = deadline - loop.time()
                full_rows = self.max_batch_rows is not None and self._queued_rows() >= self.max_batch_rows
                if len(self._queue) >= target or remaining <= 0 or full_rows:
                    break
                timeout = remaining if gap is None or len(self._queue) < informed else min(remaining, gap)
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout)
                except asyncio.TimeoutError:
                    break
            # 2. take what is queued (callers that gave up are dropped) and run it
            taken = self._take()
            if not taken:
                continue
            try:
                results = await self._run([item for item, _ in taken])
                if len(results) != len(taken):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(taken)} items")
            except Exception as exc:  # the batch's callers get the error; the worker keeps serving
                log.exception("batch of %d failed", len(taken))
                for _, fut in taken:
                    if not fut.done():
                        fut.set_exception(exc)
                self.expected = 1
                continue
            # this batch's clients come back, and those that queued meanwhile are waiting: together, the next batch
            self.expected = len(taken) + len(self._queue)
            for (_, fut), result in zip(taken, results):
                if not fut.done():
                    fut.set_result(result)
