"""Calls from the ingress to the other deployments: every wait bounded, Serve's gRPC transport where it exists."""

from __future__ import annotations

import asyncio
from typing import Any


async def bounded(awaitable: Any, timeout_s: float) -> Any:
    """Await a DeploymentResponse (or any awaitable) for at most `timeout_s`; on timeout cancel it and raise."""

    async def wait() -> Any:
        return await awaitable

    try:
        return await asyncio.wait_for(wait(), timeout_s)
    except asyncio.TimeoutError:
        cancel = getattr(awaitable, "cancel", None)
        if cancel is not None:
            cancel()
        raise


def over_grpc(handle: Any) -> Any:
    """The handle with Serve's gRPC transport between replicas instead of Ray actor calls (`_by_reference=False`).

    It shortens the dead time between batches (docs/benchmarks.md, "Serving path settings"). The option lives on the
    handle the controller built, so it is set here rather than by environment. Local testing mode's handles have no
    such option and are returned as they are.
    """
    try:
        return handle.options(_by_reference=False)
    except TypeError:
        return handle
