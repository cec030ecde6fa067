"""Session routing to policy replicas.

A request's routing key (explicit `parameters.routing_key`, else its first session id) becomes the Serve request's
`session_id`, and travels in the ModelBatch too (`routing_key`), so the Policy replica can report the keys it holds.
`serve_graph.session_router.SessionRouter` keeps a key on the replica that reports it and places a new key on a
least-loaded replica, the same on every caller process (docs/serving.md, "How sessions are placed"). Routing is still
only a hint: the policy replica checks continuity itself (steps, incarnations, restarts) and reports it.
"""

from __future__ import annotations

import contextvars
from typing import Any

from ray.serve.config import RequestRouterConfig

from serve_graph.session_router import ROUTING_STATS_PERIOD_S, ROUTING_STATS_TIMEOUT_S, SESSION_ROUTER

#: prefix of session ids created for OpenPI WebSocket connections
WS_SESSION_PREFIX = "ws"


def ws_session_id(connection_id: str, session_id: str) -> str:
    """Namespace a WebSocket client's session id by its connection, so two robots both saying "default" never share."""
    return f"{WS_SESSION_PREFIX}-{connection_id}:{session_id}"


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


def policy_generate(handle: Any, key: str, batch: Any) -> Any:
    """Start `Policy.generate(batch)` routed by `key`; the key also rides in the batch for the replica's report."""
    batch.routing_key = key
    return sticky_call(handle, "generate", key, batch)
