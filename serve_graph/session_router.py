"""Session-aware request routing to Policy replicas: a live session stays on the replica that holds its state.
Keys arrive scoped by the caller's tenant (`deployments.tenants.scoped_id`, applied by the graph runner), so two
tenants' equal session ids are two keys, placed and held apart.

Why not a hash ring: a ring moves a share of its keys whenever the replica set changes, so every scale-up restarted
robots mid-episode and a dead replica's sessions restarted twice (on a survivor, then on its replacement). Here:

1. Every Policy replica reports the routing keys of the sessions it holds through Serve's routing-stats hook
   (`record_routing_stats`, polled by the controller every `request_routing_stats_period_s` and broadcast to every
   router when the report changes). A request whose key a live replica holds goes there, whatever was added since.
2. A key nobody holds goes to a replica chosen by rendezvous (highest-random-weight) hashing over the least-loaded
   replicas (session count within `load_slack` of the minimum): a pure function of (key, broadcast), so every router
   instance (one per ingress replica and proxy) picks the same replica without talking to the others, and new
   sessions land on new replicas after a scale-up.
   An orphan (a key last reported by a replica that is gone: it died or was stopped) goes by rendezvous over the live
   replicas without the load filter. Its old replica's sessions are being placed again all at once, and the survivors'
   reports of them reach the routers one replica at a time: counts that differ between two routers for a moment
   must not send one orphan to two replicas (a second restart). The live set alone is the same for every router.
3. Between a session's first request and the next stats broadcast, each router remembers where it placed the key
   (`placement_ttl_s`); other routers compute the same placement from the same broadcast.
4. A replica that Serve stops (scale-down) leaves the broadcast at once: it gets no new sessions and its sessions
   are placed again, once, on survivors; the Policy replica flags them restarted (`new_session` / `step_mismatch`).

Ray APIs used here that are alpha or private, pinned by `ray[serve]==2.60.*` and checked by
`tests/unit/serve_graph/test_session_router.py::test_ray_router_api_is_what_we_build_on`:
- `ray.serve.request_router.RequestRouter` / `RunningReplica.routing_stats` / `PendingRequest.metadata.session_id`
  (the request-router API, alpha);
- `ray.serve.experimental.consistent_hash_router.ConsistentHashRouter`, subclassed for its routing loop, which keeps
  a popped request retrying until it is placed (the base loop can orphan same-session bursts) and its
  `_routing_key(pending_request)` (session id, else the internal request id);
- the private `_replicas` mapping (replica id -> RunningReplica) of `RequestRouter`;
- Serve's private behaviour this design relies on, checked by source there too: the hook name
  `record_routing_stats`, a STOPPING (draining) replica leaving `get_running_replica_infos` (the broadcast) at once,
  and the pending-request index by internal id that `deployments.routing.sticky_call` works around.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ray.serve.config import RequestRouterConfig
from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

from deployments.routing import STATS_KEYS, STATS_SESSIONS

log = logging.getLogger("dreamzero.serve")

#: the class path for `request_router_config.request_router_class`
SESSION_ROUTER = "serve_graph.session_router.SessionRouter"
#: how often the controller asks each Policy replica for its sessions. Each poll is one small actor call per replica;
#: a report is broadcast only when it changed (sessions started or ended), so 1 s costs little and bounds the window
#: in which only the placing router knows where a new session lives.
ROUTING_STATS_PERIOD_S = 1.0
ROUTING_STATS_TIMEOUT_S = 10.0
#: how long a router trusts its own placement of a key no replica reports yet. Long on purpose: a report can lag far
#: behind a placement on a loaded controller, and trusting a placement too long costs nothing (a replica that died
#: is never chosen; one that lost the state restarts the session, flagged), while forgetting it too early moves a
#: live session. A report of the key replaces the memo at once.
PLACEMENT_TTL_S = 120.0


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one live Policy replica (from its last routing-stats report)."""

    replica_id: str
    keys: frozenset[str] = frozenset()
    sessions: int = 0
    reported: bool = True  # False until the controller delivered this replica's first report (it just joined)


def replica_view(replica_id: str, stats: Mapping | None) -> ReplicaView:
    """A replica's report as a view; a missing or malformed report counts as an empty replica."""
    reported = isinstance(stats, Mapping) and STATS_KEYS in stats
    stats = stats if isinstance(stats, Mapping) else {}
    keys = stats.get(STATS_KEYS) or ()
    sessions = stats.get(STATS_SESSIONS)
    keys = frozenset(str(k) for k in keys) if isinstance(keys, (list, tuple, set, frozenset)) else frozenset()
    return ReplicaView(replica_id, keys, int(sessions) if isinstance(sessions, int) else len(keys), reported)


def rendezvous_score(key: str, replica_id: str) -> int:
    """Highest-random-weight score of (key, replica): the same on every process (no per-process hash seed)."""
    return int.from_bytes(hashlib.blake2b(f"{replica_id}\0{key}".encode(), digest_size=8).digest(), "big")


def choose_replica(
    key: str,
    replicas: Iterable[ReplicaView],
    placed: str | None = None,
    load_slack: int = 1,
    orphan: bool = False,
) -> str | None:
    """The replica id for routing key `key`, or None when there is no replica.

    `placed` is where this router put the key recently (before any report could show it); it is honoured while that
    replica is live and no replica reports the key. `orphan`: the key's last reporting replica is gone, so it is
    placed without the load filter (see the module docstring, 2).
    """
    views = list(replicas)
    if not views:
        return None
    holders = [r for r in views if key in r.keys]
    if holders:  # normally one; several only after a copy went stale elsewhere: agree on one, deterministically
        return max(holders, key=lambda r: rendezvous_score(key, r.replica_id)).replica_id
    if placed is not None and any(r.replica_id == placed for r in views):
        return placed
    # a replica that joined since the last reports gets new sessions only once it reported: until then the routers
    # could disagree on a session placed just before it joined (one router remembers, another recomputes)
    views = [r for r in views if r.reported] or views
    if orphan:
        return max(views, key=lambda r: rendezvous_score(key, r.replica_id)).replica_id
    least = min(r.sessions for r in views)
    eligible = [r for r in views if r.sessions <= least + load_slack]
    return max(eligible, key=lambda r: rendezvous_score(key, r.replica_id)).replica_id


class PlacementMemo:
    """Where this router placed keys that no replica reported yet; entries expire after `ttl_s`."""

    def __init__(self, ttl_s: float, clock=time.monotonic, max_entries: int = 100_000):
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._max = int(max_entries)
        self._placed: dict[str, tuple[str, float]] = {}

    def get(self, key: str) -> str | None:
        hit = self._placed.get(key)
        if hit is None:
            return None
        if self._clock() - hit[1] > self.ttl_s:
            del self._placed[key]
            return None
        return hit[0]

    def put(self, key: str, replica_id: str) -> None:
        if len(self._placed) >= self._max:
            self.prune()
            if len(self._placed) >= self._max:  # still full of fresh entries: drop the oldest
                del self._placed[next(iter(self._placed))]
        self._placed.pop(key, None)
        self._placed[key] = (replica_id, self._clock())

    def forget(self, keys: Iterable[str]) -> None:
        for k in keys:
            self._placed.pop(k, None)

    def prune(self) -> None:
        now = self._clock()
        for k in [k for k, (_, t) in self._placed.items() if now - t > self.ttl_s]:
            del self._placed[k]

    def __len__(self) -> int:
        return len(self._placed)


class LastHolders:
    """The replica that last reported each key (from the broadcasts), bounded: the oldest entries go first."""

    def __init__(self, max_entries: int = 100_000):
        self._max = int(max_entries)
        self._holder: dict[str, str] = {}

    def update(self, views: Iterable[ReplicaView]) -> None:
        for view in views:
            for key in view.keys:
                if self._holder.get(key) != view.replica_id:
                    self._holder.pop(key, None)
                    self._holder[key] = view.replica_id
        while len(self._holder) > self._max:
            del self._holder[next(iter(self._holder))]

    def is_orphan(self, key: str, live: Iterable[str]) -> bool:
        """True when the key was last reported by a replica that is not among `live`."""
        holder = self._holder.get(key)
        return holder is not None and holder not in set(live)

    def __len__(self) -> int:
        return len(self._holder)


class SessionRouter(ConsistentHashRouter):
    """Ray Serve request router for the Policy deployment (see the module docstring).

    kwargs (`request_router_kwargs`): `placement_ttl_s` (default `PLACEMENT_TTL_S`),
    `load_slack` (default 1 session).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._memo = PlacementMemo(PLACEMENT_TTL_S)
        self._load_slack = 1
        self._views: dict[str, ReplicaView] = {}
        self._last_holders = LastHolders()

    def initialize_state(self, **kwargs) -> None:
        ttl = kwargs.get("placement_ttl_s", PLACEMENT_TTL_S)
        slack = kwargs.get("load_slack", 1)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
            raise ValueError(f"placement_ttl_s must be a positive number of seconds, got {ttl!r}")
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ValueError(f"load_slack must be an integer >= 0, got {slack!r}")
        super().initialize_state(num_fallback_replicas=0)
        self._memo = PlacementMemo(float(ttl))
        self._load_slack = slack

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        self._views = {r.replica_id.unique_id: replica_view(r.replica_id.unique_id, r.routing_stats) for r in replicas}
        self._last_holders.update(self._views.values())
        reported = set().union(*(v.keys for v in self._views.values())) if self._views else set()
        self._memo.forget(reported)  # a report is the truth from now on
        self._memo.prune()

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        key = pending_request.metadata.session_id if pending_request is not None else None
        if not key:  # calls without a session (readiness probes, metadata): any replica
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._views.get(rid, ReplicaView(rid, reported=False)) for rid in by_id]
        orphan = self._last_holders.is_orphan(key, by_id)
        chosen = choose_replica(key, views, self._memo.get(key), self._load_slack, orphan)
        if chosen is None:
            return []
        if not any(key in v.keys for v in views):
            self._memo.put(key, chosen)
        return [[by_id[chosen]]]


def session_router_config() -> RequestRouterConfig:
    return RequestRouterConfig(
        request_router_class=SESSION_ROUTER,
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        # The report itself takes microseconds (it reads the session store from the replica's event loop, never
        # waiting for a model call); a slow one means an overloaded node. Past the timeout the controller drops that
        # poll and retries, keeping the previous report, so routers keep placing by slightly stale keys instead of
        # none. Ray's default (30 s) would let one stuck poll delay every newer report that long.
        request_routing_stats_timeout_s=ROUTING_STATS_TIMEOUT_S,
    )
