"""Session routing to policy replicas, the callers' and the replica's side (the router itself:
`serve_graph.session_router`, which Serve runs inside every caller's handle).

A request's routing key (explicit `parameters.routing_key`, else its first session id), scoped by the caller's tenant
like its session ids (`deployments.tenants.scoped_id`, applied by the graph runner), becomes the Serve request's
`session_id`, and travels in the ModelBatch too (`routing_key`), so the Policy replica can report the keys it holds.
`serve_graph.session_router.SessionRouter` keeps a key on the replica that reports it and places a new key on a
least-loaded replica, the same on every caller process (docs/serving.md, "How sessions are placed"). Routing is still
only a hint: the policy replica checks continuity itself (steps, incarnations, restarts) and reports it.
"""

from __future__ import annotations

import contextvars
from typing import Any

#: keys of the dict a Policy replica returns from `record_routing_stats` (`HeldKeys.live`), read by SessionRouter
STATS_KEYS = "session_keys"
STATS_SESSIONS = "sessions"
#: prefix of session ids created for OpenPI WebSocket connections
WS_SESSION_PREFIX = "ws"


def ws_session_id(connection_id: str, session_id: str) -> str:
    """Namespace a WebSocket client's session id by its connection, so two robots both saying "default" never share."""
    return f"{WS_SESSION_PREFIX}-{connection_id}:{session_id}"


def sticky_call(handle: Any, method: str, key: str, *args: Any, **kwargs: Any) -> Any:
    """Start `handle.<method>.remote(*args)` routed by `key`; returns the un-awaited DeploymentResponse.

    The call runs in a fresh contextvars.Context: in Ray 2.60 sub-requests otherwise inherit the parent request's
    internal id, and concurrent calls made inside one ingress request (several WebSocket messages of one connection,
    a gather) hang forever. Still true with SessionRouter: it keeps ConsistentHashRouter's routing loop, whose
    pending-request index (`RequestRouter._pending_requests_by_id`) holds one request per internal id, so a second
    request with the same id is never handed a replica.
    """
    bound = getattr(handle.options(session_id=key), method)
    return contextvars.Context().run(bound.remote, *args, **kwargs)


def policy_generate(handle: Any, key: str, batch: Any, limits: Any = None) -> Any:
    """Start `Policy.generate(batch)` routed by `key`; the key also rides in the batch for the replica's report.
    `limits` (deployments.tenants.SessionLimits): the tenant's session quotas, checked by the replica; sent only when
    the tenant has some."""
    batch.routing_key = key
    if limits is None:
        return sticky_call(handle, "generate", key, batch)
    return sticky_call(handle, "generate", key, batch, limits)


class HeldKeys:
    """A Policy replica's bookkeeping for its routing-stats report: routing key -> the session ids sent under it.

    A key is reported while one of its sessions lives in the replica's store or a request under it is in flight
    (a new session is in the store only once its first chunk is computed). Keys whose sessions all left the store
    (evicted, expired, dropped) are forgotten at the next report, so the map stays as small as the store.
    """

    def __init__(self) -> None:
        self._sessions: dict[str, set[str]] = {}
        self._in_flight: dict[str, int] = {}

    def enter(self, batch) -> str:
        """Note a request (a ModelBatch) on arrival; returns its key for `leave`."""
        key = batch.routing_key or batch.session_ids[0]
        self._sessions.setdefault(key, set()).update(batch.session_ids)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        return key

    def leave(self, key: str) -> None:
        n = self._in_flight.get(key, 0) - 1
        if n > 0:
            self._in_flight[key] = n
        else:
            self._in_flight.pop(key, None)

    def live(self, store) -> tuple[list[str], int]:
        """(sorted live keys, live sessions among them), pruning the rest; `store` answers `session_id in store`."""
        keys, sessions = [], 0
        for key in list(self._sessions):
            alive = {sid for sid in self._sessions[key] if sid in store}
            if alive or key in self._in_flight:
                self._sessions[key] = alive | (self._sessions[key] if key in self._in_flight else set())
                keys.append(key)
                sessions += len(alive)
            else:
                del self._sessions[key]
        return sorted(keys), sessions
