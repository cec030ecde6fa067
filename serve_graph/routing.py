"""Sticky session routing to policy replicas.

A request's routing key (explicit `parameters.routing_key`, else its first session id) becomes the Serve request's
`session_id`; Ray's `ConsistentHashRouter` maps it onto a hash ring of live replicas, a pure function of (key, replicas)
that every caller process computes identically. `num_fallback_replicas=0`: a busy owner queues the request instead of
spilling the session to a replica that holds none of its state. Routing is still only a hint: the policy replica
checks continuity itself (steps, restarts) and reports it.
"""

from __future__ import annotations

import contextvars
from typing import Any

from ray.serve.config import RequestRouterConfig

CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"

#: prefix of session ids created for OpenPI WebSocket connections
WS_SESSION_PREFIX = "ws"


def ws_session_id(connection_id: str, session_id: str) -> str:
    """Namespace a WebSocket client's session id by its connection, so two robots both saying "default" never share."""
    return f"{WS_SESSION_PREFIX}-{connection_id}:{session_id}"


def sticky_router_config(num_virtual_nodes: int = 100) -> RequestRouterConfig:
    return RequestRouterConfig(
        request_router_class=CONSISTENT_HASH_ROUTER,
        request_router_kwargs={"num_virtual_nodes": int(num_virtual_nodes), "num_fallback_replicas": 0},
    )


def sticky_call(handle: Any, method: str, key: str, *args: Any, **kwargs: Any) -> Any:
    """Start `handle.<method>.remote(*args)` routed by `key`; returns the un-awaited DeploymentResponse.

    The call runs in a fresh contextvars.Context: in Ray 2.60 sub-requests otherwise inherit the parent request's
    internal id, and concurrent consistent-hash calls made inside one ingress request (e.g. several WebSocket
    messages of one connection, or a gather) hang forever.
    """
    bound = getattr(handle.options(session_id=key), method)
    return contextvars.Context().run(bound.remote, *args, **kwargs)
