"""The ledger of live sessions per tenant across the Policy replicas, for the tenants' `max_sessions` quota.

A small named Ray actor per application (`TenantLedger`), created by the first Policy replica that needs it and
owned by it (should that replica go, the next report creates it again). Every replica that enforces a total quota
reports its own tenants' live sessions and reads the sum of the others' in the same call, at most once a second
(`LEDGER_PERIOD_S`, also from the routing-stats poll while no request comes), so its view of the other replicas is
about a second old: replicas admitting new sessions of one tenant at the same moment can pass its total by what
they admit within that second (each still bounded by `max_sessions_per_replica`). A ledger that cannot be reached
counts this replica's sessions only (fail open; the per-replica quota still holds).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger("dreamzero.serve.tenants")


class TenantLedger:
    """Live sessions per tenant of every Policy replica (the body of a small named Ray actor, one per application).

    Each replica reports its own counts and gets the sum of the others' back in the same call. A replica silent for
    `stale_s` (it died or was stopped) stops counting. The view each replica holds is at most one report period old.
    """

    def __init__(self, stale_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.stale_s, self._clock = stale_s, clock
        self._reports: dict[str, tuple[dict[str, int], float]] = {}

    def report(self, replica: str, counts: dict[str, int]) -> dict[str, int]:
        now = self._clock()
        self._reports[replica] = (dict(counts), now)
        others: dict[str, int] = {}
        for rid, (held, at) in list(self._reports.items()):
            if now - at > self.stale_s:
                del self._reports[rid]
            elif rid != replica:
                for tenant, n in held.items():
                    others[tenant] = others.get(tenant, 0) + n
        return others


#: how often a Policy replica that enforces a total quota refreshes its view of the other replicas
LEDGER_PERIOD_S = 1.0
#: the named actor lives in Serve's own namespace (where its controller and replicas are named): a replica's own
#: namespace is that of the job that started Serve, which need not be the same for every replica of an app
LEDGER_NAMESPACE = "serve"
LEDGER_TIMEOUT_S = 2.0


class LedgerLink:
    """A Policy replica's side of the ledger: reports its counts and caches the others' (fails open: while the ledger
    cannot be reached, only this replica's sessions count, and the per-replica quota still holds)."""

    def __init__(self, name: str, replica: str, counts: Callable[[], dict[str, int]], clock=time.monotonic):
        self.name, self.replica, self._counts, self._clock = name, replica, counts, clock
        self.others: dict[str, int] = {}
        self._at = -math.inf
        self._actor = None
        self._lock = asyncio.Lock()

    def _handle(self):
        if self._actor is None:
            import ray

            actor = ray.remote(num_cpus=0)(TenantLedger)
            self._actor = actor.options(name=self.name, namespace=LEDGER_NAMESPACE, get_if_exists=True).remote()
        return self._actor

    async def refresh(self, max_age_s: float = LEDGER_PERIOD_S) -> None:
        if self._clock() - self._at < max_age_s:
            return
        async with self._lock:
            if self._clock() - self._at < max_age_s:
                return
            try:
                self.others = await asyncio.wait_for(
                    self._handle().report.remote(self.replica, self._counts()), LEDGER_TIMEOUT_S
                )
            except TimeoutError:
                # slow (a ledger still starting takes seconds under load): keep the handle, since dropping the last
                # one ends the actor, and a ledger recreated on every timeout would never answer
                log.warning("tenant ledger %s slow: counting this replica's sessions only", self.name)
                self.others = {}
            except Exception as exc:  # noqa: BLE001 - the ledger died with its owner: recreate it next time
                log.warning("tenant ledger %s unreachable (%s): counting this replica's sessions only", self.name,
                            type(exc).__name__)  # fmt: skip
                self._actor, self.others = None, {}
            self._at = self._clock()
