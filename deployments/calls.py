"""Calls from the ingress to the other deployments: every wait bounded, Serve's gRPC transport where it exists."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

#: a call whose arrays hold at least this many bytes goes by reference (Ray's object store: the replica reads the
#: arrays in place); smaller ones over gRPC, which is faster for small messages and slower for large ones
#: (`benchmarks/transport_hop.py`, docs/benchmarks.md "Transport between replicas").
BY_REFERENCE_MIN_BYTES = 512 * 1024


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

    For small messages it shortens the dead time between batches (docs/benchmarks.md, "Serving path settings"); large
    ones go by reference (`Transport`). The option lives on the handle the controller built, so it is set here rather
    than by environment. Local testing mode's handles have no such option and are returned as they are.
    """
    try:
        return handle.options(_by_reference=False)
    except (TypeError, AttributeError):
        return handle


def arrays_bytes(obj: Any) -> int:
    """Bytes of the numpy arrays among an object's attributes (a ModelBatch: the canvas dominates)."""
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, np.ndarray))


class Transport:
    """A deployment handle in both of Serve's transports between replicas; `pick(nbytes)` chooses by payload size."""

    def __init__(self, handle: Any):
        self.by_reference, self.grpc = handle, over_grpc(handle)

    def pick(self, nbytes: int) -> Any:
        return self.by_reference if nbytes >= BY_REFERENCE_MIN_BYTES else self.grpc
