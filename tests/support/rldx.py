"""An RLDX-1-shaped ZMQ client for the tests, written from the shape of RLDX-1's public `PolicyClient` (a REQ socket,
one msgpack frame per message, ndarrays and ModalityConfigs as tagged maps) with its own codec, so a bug in
`dreamzero_client.wire.rldx` cannot cancel itself out. Unlike RLDX-1's client it bounds every wait (tests never hang).
"""

from __future__ import annotations

import io

import msgpack
import numpy as np
import zmq


def _default(obj):
    if isinstance(obj, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, obj, allow_pickle=False)
        return {"__ndarray_class__": True, "as_npy": buf.getvalue()}
    raise TypeError(type(obj).__name__)


def _hook(obj):
    if "__ndarray_class__" in obj:
        return np.load(io.BytesIO(obj["as_npy"]), allow_pickle=False)
    if "__ModalityConfig_class__" in obj:
        return {"modality_config": obj["as_json"]}
    return obj


class RldxShapedClient:
    def __init__(self, port: int, api_token: str | None = None, timeout_s: float = 60.0, host: str = "127.0.0.1"):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.REQ)
        self.socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{host}:{port}")
        self.api_token = api_token

    def send(self, endpoint: str, data: dict | None = None, requires_input: bool = True) -> None:
        request: dict = {"endpoint": endpoint}
        if requires_input:
            request["data"] = data
        if self.api_token:
            request["api_token"] = self.api_token
        self.socket.send(msgpack.packb(request, default=_default))

    def send_raw(self, payload: bytes) -> None:
        self.socket.send(payload)

    def receive(self):
        """The decoded reply; a `{"error": ...}` reply is returned as it is (RLDX-1 would raise RuntimeError)."""
        return msgpack.unpackb(self.socket.recv(), object_hook=_hook)

    def call(self, endpoint: str, data: dict | None = None, requires_input: bool = True):
        self.send(endpoint, data, requires_input)
        return self.receive()

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def droid_rldx_observation(b: int = 1, t: int = 4, seed: int = 0, hw=(180, 320)) -> dict:
    """What an RLDX-1 DROID rollout sends: video.<cam> uint8 (B,T,H,W,3), state.<k> float32 (B,T,D), B instructions."""
    rng = np.random.default_rng(seed)
    joints = np.array([0.0, -0.6, 0.0, -2.5, 0.0, 1.9, 0.5], np.float32)
    obs = {
        f"video.{cam}": rng.integers(0, 256, (b, t, *hw, 3), dtype=np.uint8)
        for cam in ("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left")
    }
    obs["state.joint_position"] = np.broadcast_to(joints, (b, t, 7)).copy()
    obs["state.gripper_position"] = np.full((b, t, 1), 0.25, np.float32)
    obs["annotation.language.language_instruction"] = ["pick up the cup"] * b
    return obs
