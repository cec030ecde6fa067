"""A Policy replica's admission: which requests may run, decided per request before requests are merged.

In order: the request's rows against `batching.rows_per_request` and `batching.max_batch_rows` (413, on the event
loop, before it queues); then, on the model thread, its normalised state's range (422: the model would answer NaN),
its tenant's session quotas (`SessionLimits`, 429: per replica, and in total across the replicas as the tenant ledger
last said) and the engine's own admission (the session store's slots and bytes: 503 + Retry-After). A refusal fails
its own request only, and is audited (docs/model.md "Memory and admission", docs/serving.md "Tenants and TLS").

Realtime pace (`RealtimePace`, on the event loop with the row limits; docs/fleet.md "Scheduling"): the replica fits
its model calls' cost by rows (`CallCost`: least squares ms = a + b * rows over the recent calls); a new realtime
session (its first request) whose rows, added to the realtime sessions admitted already, would make one call of all
of them take longer than the tightest budget any of them stated (`deadline_ms`) gets 503 + Retry-After saying so.
Batch rows are never refused for pace (they queue); no stated budget, or fewer than `PACE_MIN_CALLS` calls measured:
no pace check.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from deployments.tenant_ledger import LedgerLink
from deployments.tenants import SessionLimits, audit_refusal, tenant_of
from dreamzero.embodiments.base import MAX_NORMALISED_STATE
from dreamzero.errors import CapacityError, InvalidObservation, PayloadTooLarge, QuotaExceeded

if TYPE_CHECKING:
    from deployments.engine import Engine
    from dreamzero.types import ModelBatch

#: model calls measured before the cost model predicts (and the pace check acts)
PACE_MIN_CALLS = 8
#: the recent model calls the cost model fits (the cost drifts: warm-up, other load on the host)
COST_WINDOW = 64
#: a realtime session that sent nothing for this long no longer counts as admitted (a robot that stopped)
REALTIME_IDLE_S = 10.0


class CallCost:
    """The replica's measured cost of one model call by its rows: ms = a + b * rows, least squares over the last
    `COST_WINDOW` calls (a, b >= 0). None until `PACE_MIN_CALLS` calls are measured; with one size measured so far,
    that size's mean cost, scaled up in proportion above it."""

    def __init__(self, window: int = COST_WINDOW, min_calls: int = PACE_MIN_CALLS):
        self._calls: deque[tuple[int, float]] = deque(maxlen=window)
        self.min_calls = min_calls
        self._fit: tuple[float, float, int] | None = None  # (a, b, size when one size only), refitted per call

    def add(self, rows: int, ms: float) -> None:
        self._calls.append((int(rows), float(ms)))
        self._fit = None

    def __len__(self) -> int:
        return len(self._calls)

    def predict(self, rows: int) -> float | None:
        if len(self._calls) < self.min_calls:
            return None
        if self._fit is None:
            self._fit = self._refit()
        a, b, only = self._fit
        if only:  # one size measured: no fixed cost can be told apart, none is assumed above it
            return a * max(1.0, rows / only)
        return a + b * rows

    def _refit(self) -> tuple[float, float, int]:
        xs = [r for r, _ in self._calls]
        ys = [ms for _, ms in self._calls]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var == 0:
            return my, 0.0, xs[0]
        b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
        return max(0.0, my - b * mx), b, 0


def realtime_rows(batch: ModelBatch) -> list[int]:
    """The rows of `batch` served as realtime (no class stated: every row)."""
    classes = batch.traffic_class
    return list(range(len(batch))) if classes is None else [i for i, c in enumerate(classes) if c != "batch"]


def traffic_class(batch: ModelBatch) -> str:
    """A request's class for the batcher: realtime if any row is (doors resolve the class per request)."""
    return "realtime" if realtime_rows(batch) else "batch"


def earliest_deadline(batch: ModelBatch) -> float | None:
    """The earliest deadline (wall clock) a realtime row of `batch` states, None when none does."""
    if batch.deadline_at is None:
        return None
    stated = [batch.deadline_at[i] for i in realtime_rows(batch) if batch.deadline_at[i] is not None]
    return min(stated) if stated else None


class RealtimePace:
    """Which realtime sessions the replica keeps at pace; refuses a new one that would push them past it."""

    def __init__(self, cost: CallCost, retry_after_s: float):
        self.cost, self.retry_after_s = cost, retry_after_s
        self.enabled = True  # live: `batching.realtime_admission` (deployments.live_tuning)
        self._sessions: dict[str, tuple[float, float | None]] = {}  # id -> (last seen, monotonic; its budget, ms)

    def admitted(self) -> int:
        return len(self._sessions)

    def check(self, batch: ModelBatch) -> None:
        """CapacityError when `batch` starts realtime sessions the replica cannot keep at pace; else its realtime
        sessions count as admitted (each with the budget its row states: positive ones only, as a robot's first
        query, sent with an empty buffer, states 0)."""
        rows = realtime_rows(batch)
        if not rows:
            return
        now, wall = time.monotonic(), time.time()
        self._sessions = {s: v for s, v in self._sessions.items() if now - v[0] <= REALTIME_IDLE_S}
        deadlines = batch.deadline_at or [None] * len(batch)
        stated = {}
        for i in rows:
            d = deadlines[i]
            budget = (d - wall) * 1000.0 if d is not None else None
            stated[batch.session_ids[i]] = budget if budget is not None and budget > 0 else None
        new = [s for s in stated if s not in self._sessions]
        if new and self.enabled:
            self._check_room(len(new), [b for b in stated.values() if b is not None])
        for sid, budget in stated.items():
            self._sessions[sid] = (now, budget if budget is not None else self._sessions.get(sid, (0, None))[1])

    def _check_room(self, new: int, budgets: list[float]) -> None:
        budgets += [b for _, b in self._sessions.values() if b is not None]
        if not budgets:
            return
        total = len(self._sessions) + new
        predicted = self.cost.predict(total)
        if predicted is not None and predicted > min(budgets):
            raise CapacityError(
                f"realtime sessions at pace: {len(self._sessions)}; adding {new} more, a model call of their "
                f"{total} rows is predicted at {predicted:.0f} ms > deadline {min(budgets):.0f} ms (the tightest "
                "budget a realtime session states): this replica cannot keep one more robot at pace; retry later, "
                "use another replica, or send the rows as traffic_class batch",
                retry_after_s=self.retry_after_s,
            )

    def forget(self, session_ids: Iterable[str]) -> None:
        for sid in session_ids:
            self._sessions.pop(sid, None)


def check_state_range(batch: ModelBatch) -> None:
    """InvalidObservation naming the state when a row's normalised state is not finite or beyond
    `MAX_NORMALISED_STATE` (the model would answer NaN: a finite 1e30 overflows its first layer)."""
    state = np.asarray(batch.state, dtype=np.float64)
    if not np.isfinite(state).all() or (state.size and np.abs(state).max() > MAX_NORMALISED_STATE):
        raise InvalidObservation(
            f"the normalised state holds values that are not finite or beyond +-{MAX_NORMALISED_STATE:g} (training "
            "data lies within about +-1): check the state's units",
            field="input.observation.state",
        )


class Admission:
    """The replica's gate: row limits, state range, tenant session quotas (with the ledger link), engine admission."""

    def __init__(
        self,
        engine: Engine,
        metrics: Any,
        replica: str,
        ledger_name: str | None,
        rows_per_request: int | None,
        retry_after_s: float = 1.0,
    ):
        self.engine, self.metrics, self.replica = engine, metrics, replica
        self.rows_per_request = rows_per_request  # live: a `user_config` changes it (deployments.live_tuning)
        self.cost = CallCost()  # fed by the policy after every model call
        self.pace = RealtimePace(self.cost, retry_after_s)
        self._ledger_name = ledger_name  # the tenant ledger actor's; None outside Serve (this replica is the only one)
        self._ledger: LedgerLink | None = None  # started by the first request with a total session quota
        self._limits: dict[int, SessionLimits] = {}  # id(batch) -> its tenant's session quotas, while it is admitted

    async def enter(self, batch: ModelBatch, limits: SessionLimits | None) -> None:
        """A request arrives (event loop): PayloadTooLarge beyond the row limits, CapacityError for a realtime
        session the replica cannot keep at pace; its quotas are kept until `leave`."""
        self.check_rows(len(batch))
        try:
            self.pace.check(batch)
        except CapacityError as exc:
            self.metrics.realtime_refusals.inc()
            audit_refusal(tenant_of(batch.session_ids[0]), "policy", exc, len(batch))
            raise
        if limits is not None:
            if limits.total is not None:
                await self._refresh_ledger()
            self._limits[id(batch)] = limits

    def leave(self, batch: ModelBatch) -> None:
        self._limits.pop(id(batch), None)

    def share(self, batch: ModelBatch, parts: list[ModelBatch]) -> None:
        """`batch` is served as `parts` (deployments.batch_slices): each is admitted with its quotas (`leave` each)."""
        limits = self._limits.get(id(batch))
        if limits is not None:
            for part in parts:
                self._limits[id(part)] = limits

    def check_rows(self, rows: int) -> None:
        for limit, name in (
            (self.rows_per_request, "batching.rows_per_request"),
            (self.engine.max_batch_rows, "batching.max_batch_rows"),
        ):
            if limit is not None and rows > limit:
                raise PayloadTooLarge(f"the request holds {rows} session rows, more than {name}={limit}; split it")

    def admit_each(self, batches: list[ModelBatch], busy: set[str]) -> dict[int, BaseException]:
        """Admit each request's sessions (model thread); index -> error for those refused (capacity or bad input).
        `busy`: the sessions of this batch and of the queued ones, never evicted for room."""
        refused: dict[int, BaseException] = {}
        for i, batch in enumerate(batches):
            try:
                check_state_range(batch)
                limits = self._limits.get(id(batch))
                if limits is not None:
                    self._check_session_quota(batch, limits)
                self.engine.admit(batch, busy)
            except Exception as exc:  # noqa: BLE001 - capacity, quota or bad input fails its own request only
                if isinstance(exc, CapacityError):
                    self.metrics.admissions_refused.inc()
                refused[i] = exc
                audit_refusal(tenant_of(batch.session_ids[0]), "policy", exc, len(batch))
        return refused

    def tenant_counts(self) -> dict[str, int]:
        """This replica's live sessions per tenant."""
        return self.engine.store.group_counts()

    def keep_ledger_fresh(self) -> None:
        """Report to the ledger while no request comes, so the other replicas' view of this one stays fresh."""
        if self._ledger is not None:
            asyncio.ensure_future(self._ledger.refresh())

    def _check_session_quota(self, batch: ModelBatch, limits: SessionLimits) -> None:
        """QuotaExceeded when the batch's new sessions take its tenant past a session quota (the total counts the
        other replicas' sessions as the ledger last said)."""
        elsewhere = self._ledger.others.get(limits.tenant, 0) if self._ledger is not None else 0
        try:
            self.engine.store.check_group_room(
                batch.session_ids, limits.per_replica, limits.total, elsewhere, label="tenant"
            )
        except QuotaExceeded as exc:
            self.metrics.tenant_quota_refusals.inc(1, tags={"tenant": limits.tenant, "quota": exc.quota})
            raise

    async def _refresh_ledger(self) -> None:
        """Report this replica's live sessions per tenant to the ledger and read the others' (at most once a
        second); only inside a Serve replica (in-process, this replica is the only one)."""
        if self._ledger is None:
            if self._ledger_name is None:
                return
            self._ledger = LedgerLink(self._ledger_name, self.replica, self.tenant_counts)
        await self._ledger.refresh()
