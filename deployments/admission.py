"""A Policy replica's admission: which requests may run, decided per request before requests are merged.

In order: the request's rows against `batching.rows_per_request` and `batching.max_batch_rows` (413, on the event
loop, before it queues); then, on the model thread, its normalised state's range (422: the model would answer NaN),
its tenant's session quotas (`SessionLimits`, 429: per replica, and in total across the replicas as the tenant ledger
last said) and the engine's own admission (the session store's slots and bytes: 503 + Retry-After). A refusal fails
its own request only, and is audited (docs/model.md "Memory and admission", docs/serving.md "Tenants and TLS").
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np

from deployments.tenant_ledger import LedgerLink
from deployments.tenants import SessionLimits, audit_refusal, tenant_of
from dreamzero.embodiments.base import MAX_NORMALISED_STATE
from dreamzero.errors import CapacityError, InvalidObservation, PayloadTooLarge, QuotaExceeded

if TYPE_CHECKING:
    from deployments.engine import Engine
    from dreamzero.types import ModelBatch


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
        self, engine: Engine, metrics: Any, replica: str, ledger_name: str | None, rows_per_request: int | None
    ):
        self.engine, self.metrics, self.replica = engine, metrics, replica
        self.rows_per_request = rows_per_request  # live: a `user_config` changes it (deployments.live_tuning)
        self._ledger_name = ledger_name  # the tenant ledger actor's; None outside Serve (this replica is the only one)
        self._ledger: LedgerLink | None = None  # started by the first request with a total session quota
        self._limits: dict[int, SessionLimits] = {}  # id(batch) -> its tenant's session quotas, while it is admitted

    async def enter(self, batch: ModelBatch, limits: SessionLimits | None) -> None:
        """A request arrives (event loop): PayloadTooLarge beyond the row limits; its quotas are kept until `leave`."""
        self.check_rows(len(batch))
        if limits is not None:
            if limits.total is not None:
                await self._refresh_ledger()
            self._limits[id(batch)] = limits

    def leave(self, batch: ModelBatch) -> None:
        self._limits.pop(id(batch), None)

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
