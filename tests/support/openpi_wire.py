"""A minimal OpenPI WebSocket client written only against the wire format, for the cluster tests of the OpenPI and
ZeroMQ doors: plain `websockets` + `msgpack` with the openpi `__ndarray__` marker, as openpi-client / RoboArena speak
it, deliberately without the project's own codec (a bug there cannot cancel itself out)."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import websockets

from tests.support.cluster import API_KEY
from tests.support.observations import openpi_droid_observation

WS_PATH = "/v1/realtime/robot/openpi"
RECV_TIMEOUT_S = 180


def _pack_array(obj):
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    raise TypeError(type(obj))


def _unpack_array(obj):
    if b"__ndarray__" in obj:
        return np.frombuffer(obj[b"data"], dtype=np.dtype(obj[b"dtype"])).reshape(obj[b"shape"])
    return obj


def pack(obj) -> bytes:
    return msgpack.packb(obj, default=_pack_array, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, object_hook=_unpack_array, raw=False, strict_map_key=False)


def droid_frame(t: int | None = None, seed: int = 0) -> dict:
    """A DROID frame's observation alone (no prompt, no session id: each test adds its own)."""
    return openpi_droid_observation(seed, prompt=None, frames=t, gripper=0.2, cartesian=True)


def ws_url(base: str, path: str = WS_PATH) -> str:
    return base.replace("http://", "ws://") + path


async def recv(ws):
    return unpack(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))


def connect(base: str, path: str = WS_PATH, key: str | None = API_KEY, scheme: str = "Api-Key"):
    headers = {"Authorization": f"{scheme} {key}"} if key else {}
    return websockets.connect(
        ws_url(base, path), additional_headers=headers, max_size=None, open_timeout=30, close_timeout=5
    )
