"""The OpenPI WebSocket endpoint driven by a client written only against the wire format.

Deliberately no project imports in the protocol code below: plain `websockets` + `msgpack` with the openpi
`__ndarray__` marker, as openpi-client / RoboArena speak it.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest
import websockets

from tests.cluster.conftest import API_KEY
from tests.support.observations import openpi_droid_observation

pytestmark = pytest.mark.cluster

WS_PATH = "/v1/realtime/robot/openpi"
RECV_TIMEOUT_S = 180


# --- a minimal openpi wire client -------------------------------------------------------------------------------------
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


# --- tests ------------------------------------------------------------------------------------------------------------
def test_session_flow_handshake_infer_reset_errors(front_door):
    async def run():
        async with connect(front_door) as ws:
            hello = await recv(ws)
            assert hello["image_resolution"] == [180, 320] and hello["n_external_cameras"] == 2
            assert hello["needs_wrist_camera"] is True and hello["needs_session_id"] is True
            assert hello["action_space"] == "joint_position" and len(hello) == 6  # the reference keys, no more

            # 1. first infer: one frame per camera; DreamZero-style (endpoint sent) -> bare (24, 8) array
            await ws.send(
                pack({"endpoint": "infer", "session_id": "ep1", "prompt": "pick up the cup", **droid_frame()})
            )
            actions = await recv(ws)
            assert isinstance(actions, np.ndarray) and actions.dtype == np.float32 and actions.shape == (24, 8)

            # 2. a 4-frame stack, no endpoint, the dict form asked for -> {"actions": ...} with the session report
            dict_form = {"session_id": "ep1", "prompt": "pick up the cup", "response_format": "dict"}
            await ws.send(pack({**dict_form, **droid_frame(t=4, seed=1)}))
            reply = await recv(ws)
            assert reply["actions"].shape == (24, 8)
            assert reply["session"]["step"] == 2 and reply["session"]["restarted"] is False

            # 3. a malformed frame: error frame, socket stays open; a text frame too
            await ws.send(b"\xc1\xc1")
            err = await recv(ws)
            assert err["type"] == "error" and err["message"]
            await ws.send("not msgpack")
            assert (await recv(ws))["type"] == "error"
            await ws.send(pack({"endpoint": "infer", "session_id": "ep1", "prompt": "x"}))  # no observation
            err = await recv(ws)
            assert err["type"] == "error" and "observation/" in err["message"]

            # 4. the socket still serves: a single frame after the first call goes through the frame buffer (4 frames)
            await ws.send(pack({**dict_form, **droid_frame(seed=2)}))
            reply = await recv(ws)
            assert reply["session"]["step"] == 3 and reply["session"]["restarted"] is False

            # 5. reset -> the next infer restarts the session
            await ws.send(pack({"endpoint": "reset"}))
            assert await recv(ws) == {"status": "reset successful"}
            await ws.send(pack({**dict_form, **droid_frame(seed=3)}))
            reply = await recv(ws)
            assert reply["session"]["restarted"] is True and reply["session"]["step"] == 1

    asyncio.run(run())


def test_oversized_frame_is_refused(front_door):
    async def run():
        async with connect(front_door) as ws:
            await recv(ws)
            await ws.send(b"\x00" * (3 * 1024 * 1024))  # over the 2 MiB test limit
            err = await recv(ws)
            assert err["type"] == "error" and "limit" in err["message"]
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 30)
            assert info.value.rcvd.code == 1009

    asyncio.run(run())


def test_idle_connection_is_closed(front_door):
    async def run():
        async with connect(front_door, path="/") as ws:  # the server root speaks the same protocol
            assert "image_resolution" in await recv(ws)
            t0 = time.monotonic()
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 30)
            assert info.value.rcvd.code == 1000 and 3.0 < time.monotonic() - t0 < 20

    asyncio.run(run())


@pytest.mark.parametrize("key, scheme", [(None, "Api-Key"), ("wrong", "Bearer")])
def test_websocket_needs_the_api_key(front_door, key, scheme):
    async def run():
        with pytest.raises((websockets.InvalidStatus, websockets.ConnectionClosed)):
            async with connect(front_door, key=key, scheme=scheme) as ws:
                await recv(ws)

    asyncio.run(run())
