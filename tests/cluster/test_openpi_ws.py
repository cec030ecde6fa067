"""The OpenPI WebSocket endpoint driven by a client written only against the wire format (tests/support/openpi_wire.py:
no project imports in its protocol code, plain `websockets` + `msgpack` with the openpi `__ndarray__` marker, as
openpi-client / RoboArena speak it).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import websockets

from tests.support.openpi_wire import connect, droid_frame, pack, recv

pytestmark = pytest.mark.cluster


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
