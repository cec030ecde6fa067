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

Traffic classes (`class_of(item)`: "realtime", a robot, or "batch", an evaluation farm; docs/fleet.md "Scheduling").
With `classes` on, a call is filled in this order: a batch request owed its floor (below), then realtime requests,
earliest `deadline_of(item)` first (those stating none after them, in arrival order), then batch requests in arrival
order; the first request that does not fit the bounds ends the call, as above. Batch requests stop joining a call
with realtime rows once `call_ms(rows)` (the replica's measured cost) predicts the call would take more than
`REALTIME_SHARE` of the time left to the earliest realtime deadline in it. Batch is never starved: when
`floor_calls` consecutive calls took no batch row while batch requests waited, the next call takes the oldest
batch request first. The company wait never holds realtime rows for batch company: while a realtime request is
queued it waits (at most `wait_s`) only for the realtime requests of the previous call. A request's sessions keep
their arrival order (`sessions_of`): a request is never taken before an earlier queued one sharing a session. With
`classes` off (or no `class_of`) the batcher is first come, first served.

A robot's next request is foreseen, too (classes on, `call_ms` and `clock` given): the batcher notes each realtime
request's sessions, when it came, the interval since the same sessions' previous one (their cadence) and the budget
it stated (`deadline_of` - arrival). A model call is never interrupted, so a farm call longer than a robot's budget
that starts just before the robot's request would make it late whatever the order. Batch requests therefore stop
joining a call (a batch-only one included) that `call_ms` predicts would still run when a robot's next request is
due so late that the robot's own call would end past `REALTIME_SHARE` of its budget; with no batch request fit to
start, the model waits for that robot (until it is due plus `HOLD_GRACE` of its cadence: one that does not come is
not waited for again), serves it, and the farm runs after it. The floor still holds: a batch request owed its floor
starts anyway. `slice_rows` tells the Policy how many rows of a farm's request a robot can wait out
(deployments.batch_slices cuts larger ones).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger("dreamzero.serve.batcher")

#: a wait for sessions starting together ends when none arrived for this share of `wait_s`
COMPANY_GAP = 0.25
#: batch rows are planned so a robot's call ends within this share of the time it has left (the rest absorbs the
#: cost model's error and the host's other load; a late answer also shrinks the budget the robot's next query states)
REALTIME_SHARE = 0.5
#: batch waits for a robot due to send at most this share of its cadence past when it was due
HOLD_GRACE = 0.25
#: a realtime session not heard from for this many of its intervals is forgotten (a robot that stopped)
CADENCE_EXPIRY = 4.0
#: ... and one seen once, after this many seconds
CADENCE_FORGET_S = 10.0
REALTIME, BATCH = "realtime", "batch"

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class _Entry(Generic[Item]):
    item: Item
    future: asyncio.Future
    seq: int  # arrival order
    realtime: bool = True
    deadline: float | None = None
    sessions: frozenset[str] = frozenset()


@dataclass
class _Cadence:
    """A realtime request's sessions as last seen: when (the deadline clock), the interval since the previous
    request of the same sessions, the budget stated (s) and its rows."""

    last: float
    interval: float | None
    budget: float | None
    rows: int


class ContinuousBatcher(Generic[Item, Result]):
    """`await submit(item)` -> that item's result from `run(list_of_items)`, one `run` at a time; a call's items are
    passed in arrival order, whichever order chose them."""

    def __init__(
        self,
        run: Callable[[list[Item]], Awaitable[list[Result]]],
        max_batch_size: int,
        wait_s: float,
        wants_company: Callable[[Item], bool] | None = None,
        rows_of: Callable[[Item], int] | None = None,
        max_batch_rows: int | None = None,
        class_of: Callable[[Item], str] | None = None,
        deadline_of: Callable[[Item], float | None] | None = None,
        sessions_of: Callable[[Item], Iterable[str]] | None = None,
        call_ms: Callable[[int], float | None] | None = None,
        floor_calls: int = 4,
        clock: Callable[[], float] | None = None,
    ):
        if max_batch_size < 1 or wait_s < 0:
            raise ValueError(f"max_batch_size must be >= 1 and wait_s >= 0, got {max_batch_size}, {wait_s}")
        if max_batch_rows is not None and max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1 or None, got {max_batch_rows}")
        if floor_calls < 1:
            raise ValueError(f"floor_calls must be >= 1, got {floor_calls}")
        self._run, self.max_batch_size, self.wait_s = run, max_batch_size, wait_s
        self._rows_of = rows_of or (lambda item: 1)
        self.max_batch_rows = max_batch_rows
        self._wants_company = wants_company
        self._class_of, self._deadline_of, self._sessions_of = class_of, deadline_of, sessions_of
        self._call_ms = call_ms  # predicted ms of a call of n rows, None while unknown
        self._clock = clock  # the clock of `deadline_of` (wall clock seconds); None: deadlines only order
        self.classes = class_of is not None  # live: `batching.traffic_classes` (deployments.live_tuning)
        self.floor_calls = floor_calls  # live: `batching.batch_floor_calls`
        self._queue: list[_Entry] = []
        self._seq = 0
        self._arrived: asyncio.Event | None = None  # created on the serving loop
        self._worker: asyncio.Task | None = None
        self.expected = 1  # requests active during the previous batch: the company the next one waits for
        self.expected_realtime = 0  # of those, realtime ones (classes on)
        self.batch_starved = 0  # consecutive calls that took no batch request while one waited
        self._cadence: dict[frozenset[str], _Cadence] = {}  # realtime sessions -> when their next request is due
        self._noted = 0
        self._hold_until: float | None = None  # batch waits for a robot due to send until then (clock), if set

    async def submit(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._arrived = asyncio.Event()
            self._worker = loop.create_task(self._serve_forever())
        entry = _Entry(item, loop.create_future(), self._seq)
        self._seq += 1
        if self._sessions_of is not None:
            entry.sessions = frozenset(self._sessions_of(item))
        if self._class_of is not None:
            try:
                entry.realtime = self._class_of(item) != BATCH
                entry.deadline = self._deadline_of(item) if self._deadline_of is not None else None
            except Exception:  # a hint only: an item whose class cannot be read is served as realtime, unordered
                log.exception("class_of / deadline_of failed; serving the request as realtime")
            if entry.realtime and entry.sessions and self._clock is not None:
                self._note_cadence(entry)
        self._queue.append(entry)
        self._arrived.set()
        return await entry.future

    def queued(self) -> list[Item]:
        """Items waiting for a batch (their sessions are busy: admission must not evict them)."""
        return [e.item for e in self._queue if not e.future.done()]

    def _queued_rows(self) -> int:
        return sum(self._rows_of(e.item) for e in self._queue if not e.future.done())

    def _classed(self) -> bool:
        return self.classes and self._class_of is not None

    def _take(self) -> list[_Entry]:
        """The next batch: queued requests in the order the batcher's rules give while they fit both bounds (at
        least one, unless batch requests wait for a robot due to send: then none, and `_hold_until` says until
        when), handed back in arrival order."""
        self._queue = [e for e in self._queue if not e.future.done()]  # callers that gave up
        self._hold_until = None
        order = self._order() if self._classed() else list(self._queue)
        owed = order[0] if order and self._classed() and self.batch_starved >= self.floor_calls else None
        queued_sessions = frozenset().union(*(e.sessions for e in self._queue))
        taken: list[_Entry] = []
        rows = 0
        deadline = None  # the earliest realtime deadline among the rows taken
        blocked: dict[str, int] = {}  # session -> arrival of its earliest request passed over: later ones wait too
        for e in order:
            if len(taken) >= self.max_batch_size:
                break
            n = self._rows_of(e.item)
            if taken and self.max_batch_rows is not None and rows + n > self.max_batch_rows:
                break
            if self._classed() and taken and not e.realtime and self._late(deadline, rows + n):
                break  # batch comes last and in arrival order: none joins a call it would make late
            if self._classed() and not e.realtime and e is not owed:
                due = self._robot_due(rows + n, queued_sessions)
                if due is not None:  # nor a call still running when a robot's request is due too late
                    if not taken:
                        self._hold_until = due
                    break
            if any(blocked.get(sid, e.seq) < e.seq for sid in e.sessions) or (
                self._classed() and self._waits_for_earlier(e, taken)
            ):
                for sid in e.sessions:
                    blocked[sid] = min(blocked.get(sid, e.seq), e.seq)
                continue
            taken.append(e)
            rows += n
            if e.realtime and e.deadline is not None:
                deadline = e.deadline if deadline is None else min(deadline, e.deadline)
        chosen = {id(e) for e in taken}
        self._queue = [e for e in self._queue if id(e) not in chosen]
        if self._classed() and taken:
            waited = any(not e.realtime for e in order)
            self.batch_starved = 0 if any(not e.realtime for e in taken) or not waited else self.batch_starved + 1
        return sorted(taken, key=lambda e: e.seq)

    def _order(self) -> list[_Entry]:
        """Classes on: a batch request owed its floor, realtime by deadline (none stated: after, in arrival order),
        then batch in arrival order."""
        realtime = [e for e in self._queue if e.realtime]
        batch = [e for e in self._queue if not e.realtime]
        realtime.sort(key=lambda e: (e.deadline is None, e.deadline if e.deadline is not None else 0.0, e.seq))
        if batch and self.batch_starved >= self.floor_calls:
            return [batch[0], *realtime, *batch[1:]]
        return realtime + batch

    def _waits_for_earlier(self, e: _Entry, taken: list[_Entry]) -> bool:
        """Is an earlier queued request sharing a session with `e` not taken (yet)? Then `e` waits for it."""
        if not e.sessions:
            return False
        chosen = {id(t) for t in taken}
        return any(q.seq < e.seq and id(q) not in chosen and e.sessions & q.sessions for q in self._queue)

    def slice_rows(self) -> int | None:
        """The most rows of a batch call that a robot asking just as it starts can wait out: its call followed by
        the robot's own fits the tightest budget a live realtime session stated (at least 1); None while no robot
        states a budget or the cost is unknown (deployments.batch_slices cuts batch requests to it)."""
        if not self._classed() or self._call_ms is None or self._clock is None:
            return None
        now = self._clock()
        room = None
        for c in self._cadence.values():
            if c.budget is None or self._gone(c, now):
                continue
            own = self._call_ms(c.rows)
            if own is None:
                return None
            left = REALTIME_SHARE * c.budget * 1000.0 - own
            room = left if room is None else min(room, left)
        if room is None:
            return None
        rows = 1
        while rows < (self.max_batch_rows or 1024) and (self._call_ms(rows + 1) or 0.0) <= room:
            rows += 1
        return rows

    def _note_cadence(self, entry: _Entry) -> None:
        """A realtime request arrives: when its sessions' next one is due and what budget it will state."""
        now = self._clock()
        prev = self._cadence.get(entry.sessions)
        interval = now - prev.last if prev is not None and now > prev.last else None
        budget = entry.deadline - now if entry.deadline is not None and entry.deadline > now else None
        if budget is None and prev is not None:  # a robot asking with an empty buffer states none: keep the last
            budget = prev.budget
        self._cadence[entry.sessions] = _Cadence(now, interval, budget, self._rows_of(entry.item))
        self._noted += 1
        if self._noted % 128 == 0:  # sessions that stopped go, even while no batch request asks
            self._cadence = {k: c for k, c in self._cadence.items() if not self._gone(c, now)}

    @staticmethod
    def _gone(c: _Cadence, now: float) -> bool:
        return now - c.last > (CADENCE_EXPIRY * c.interval if c.interval else CADENCE_FORGET_S)

    def _robot_due(self, rows: int, skip: frozenset[str]) -> float | None:
        """Would a call of `rows` rows, started now, still run when a robot's next request is due, so late that its
        own call would end after its budget? Then until when to wait for it (clock), else None. `skip`: sessions
        with a request queued (theirs goes first)."""
        if self._call_ms is None or self._clock is None or not self._cadence:
            return None
        predicted = self._call_ms(rows)
        if predicted is None:
            return None
        now = self._clock()
        end = now + predicted / 1000.0
        hold = None
        for key, c in list(self._cadence.items()):
            if self._gone(c, now):
                del self._cadence[key]  # a robot that stopped
                continue
            if c.interval is None:
                continue
            due, grace = c.last + c.interval, HOLD_GRACE * c.interval
            if c.budget is None or key & skip or now > due + grace:  # overdue past the grace: not waited for
                continue
            own = self._call_ms(c.rows)
            arrival = max(due, now)
            if own is not None and max(end, arrival) + own / 1000.0 > arrival + REALTIME_SHARE * c.budget:
                hold = due + grace if hold is None else min(hold, due + grace)
        return hold

    def _late(self, deadline: float | None, rows: int) -> bool:
        """Would a call of `rows` rows, started now, take more than `REALTIME_SHARE` of the time left to the realtime
        `deadline` of rows already taken?"""
        if deadline is None or self._call_ms is None or self._clock is None:
            return False
        predicted = self._call_ms(rows)
        now = self._clock()
        return predicted is not None and predicted / 1000.0 > REALTIME_SHARE * (deadline - now)

    def _target(self) -> tuple[int, int, float | None]:
        """How many queued requests the next batch waits for (at most `wait_s`), how many count towards it, and the
        arrival gap that ends the wait early (None: only the deadline does). A queued realtime request waits only
        for realtime company (classes on)."""
        live = [e for e in self._queue if not e.future.done()]
        if self._classed() and any(e.realtime for e in live):
            live = [e for e in live if e.realtime]
            target = min(max(self.expected_realtime, 1), self.max_batch_size)
        else:
            target = min(self.expected, self.max_batch_size)
        if target < self.max_batch_size and self._wants_company is not None:
            try:
                wanted = any(self._wants_company(e.item) for e in live)
            except Exception:  # a hint only: never let it stop the worker (and hang its callers)
                log.exception("wants_company failed; batching without the hint")
                wanted = False
            if wanted:
                return self.max_batch_size, len(live), self.wait_s * COMPANY_GAP
        return target, len(live), None

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
                target, count, gap = self._target()
                remaining = deadline - loop.time()
                full_rows = self.max_batch_rows is not None and self._queued_rows() >= self.max_batch_rows
                if count >= target or remaining <= 0 or full_rows:
                    break
                timeout = remaining if gap is None or count < informed else min(remaining, gap)
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout)
                except asyncio.TimeoutError:
                    break
            # 2. take what is queued (callers that gave up are dropped) and run it
            taken = self._take()
            if not taken:
                if self._hold_until is not None:  # batch waits for a robot due to send (bounded by its grace)
                    self._arrived.clear()
                    try:
                        await asyncio.wait_for(self._arrived.wait(), max(0.0, self._hold_until - self._clock()))
                    except asyncio.TimeoutError:
                        pass
                continue
            try:
                results = await self._run([e.item for e in taken])
                if len(results) != len(taken):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(taken)} items")
            except Exception as exc:  # the batch's callers get the error; the worker keeps serving
                log.exception("batch of %d failed", len(taken))
                for e in taken:
                    if not e.future.done():
                        e.future.set_exception(exc)
                self.expected, self.expected_realtime = 1, 0
                continue
            # this batch's clients come back, and those that queued meanwhile are waiting: together, the next batch
            self.expected = len(taken) + len(self._queue)
            self.expected_realtime = sum(e.realtime for e in taken) + sum(e.realtime for e in self._queue)
            for e, result in zip(taken, results):
                if not e.future.done():
                    e.future.set_result(result)
