"""Request builders shared by the graph, cluster and e2e tests (DROID raw form, RLinf normalised form)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np

from dreamzero_client.wire import codec, generations

DROID_VIEWS = ("video.exterior_image_1_left", "video.exterior_image_2_left", "video.wrist_image_left")


def droid_raw_observation(b: int = 1, t: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = {k: rng.integers(0, 256, (b, t, 180, 320, 3), dtype=np.uint8) for k in DROID_VIEWS}
    obs["state.joint_position"] = rng.uniform(-1, 1, (b, 7)).astype(np.float32)
    obs["state.gripper_position"] = rng.uniform(0, 1, (b, 1)).astype(np.float32)
    return obs


def openpi_droid_observation(seed: int, session_id: str, prompt: str = "pick up the cup") -> dict:
    """One OpenPI DROID frame as an openpi client sends it (flat `observation/...` keys, one unbatched step)."""
    rng = np.random.default_rng(seed)
    img = lambda: rng.integers(0, 256, (180, 320, 3), dtype=np.uint8)  # noqa: E731
    return {
        "observation/exterior_image_0_left": img(),
        "observation/exterior_image_1_left": img(),
        "observation/wrist_image_left": img(),
        "observation/joint_position": rng.uniform(-1, 1, 7).astype(np.float32),
        "observation/gripper_position": np.array([0.0], np.float32),
        "prompt": prompt,
        "session_id": session_id,
    }


def normalised_observation(b: int = 2, t: int = 1, hw: tuple[int, int] = (64, 128), seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, 1, 64), bool)
    mask[..., :8] = True
    return {
        "images": rng.integers(0, 256, (b, t, *hw, 3), dtype=np.uint8),
        "state": (rng.uniform(-1, 1, (b, 1, 64)) * mask).astype(np.float32),
        "state_mask": mask,
        "embodiment_id": np.full((b,), 17, np.int64),
        "has_lapa_action": np.zeros((b,), bool),
        "is_cotrain_instance": np.zeros((b,), bool),
    }


def raw_body(session_ids: list[str], t: int = 1, flavour: str = codec.OPENPI, **kwargs) -> bytes:
    body = generations.build_request_body(
        droid_raw_observation(len(session_ids), t), ["pick up the cup"] * len(session_ids), session_ids, **kwargs
    )
    return codec.encode_body(body, flavour)[0]


def normalised_body(session_ids: list[str], t: int = 1, flavour: str = codec.OPENPI, **kwargs) -> bytes:
    """RLinf's normalised form; T=1 starts a session, later calls send 4-frame stacks (1 frame would restart it)."""
    b = len(session_ids)
    body = generations.build_request_body(
        normalised_observation(b, t), ["a formatted prompt"] * b, session_ids, **kwargs
    )
    return codec.encode_body(body, flavour)[0]


def content_type(flavour: str) -> str:
    return codec.content_type_for(flavour)


def decode(payload: bytes, flavour: str = codec.OPENPI):
    if flavour == codec.JSON:
        return codec.decode_json(payload)
    return codec.decode_msgpack(payload)[0]


class LocalHandle:
    """A deployment handle over a plain object, for doors run in-process: `handle.options(...).method.remote(...)`
    -> an awaitable, awaiting the target's async methods as Serve does."""

    def __init__(self, target):
        self.target = target

    def options(self, **_):
        return self

    def __getattr__(self, name):
        method = getattr(self.target, name)

        async def call(*args, **kwargs):
            out = method(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out

        return SimpleNamespace(remote=call)
