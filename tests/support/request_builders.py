"""Request builders shared by the graph, cluster and e2e tests (DROID raw form, RLinf normalised form; the OpenPI
frame is tests/support/observations.py's)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
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


GENERATIONS = "/v1/actions/generations"
#: the graph tier's app (tests/graph): the embedded tiny model with the cheapest loop that runs every stage
GRAPH_ARGS = {
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 8},
}


@contextmanager
def served_over_http(args: dict, name: str) -> Iterator:
    """`build_app(args)` in Serve's local testing mode behind the Ingress's own ASGI app (Starlette's TestClient):
    requests take the HTTP door's real routes, key check and error handlers, and the deployments' real Serve handles.
    Local testing mode has no HTTP proxy, so the Ingress is built here over the handles of the deployments the
    application binds it to (read from the bound application: Ray has no public accessor for them)."""
    from ray import serve
    from starlette.testclient import TestClient

    from deployments.ingress import IngressDeployment
    from serve_graph.builder import build_app

    bound = build_app(args)._bound_deployment
    *stages, settings = bound.init_args
    handles = [
        serve.run(stage, name=f"{name}-{i}", route_prefix=None, _local_testing_mode=True)
        for i, stage in enumerate(stages)
    ]
    ingress = IngressDeployment(*handles, settings)
    with TestClient(ingress.__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
        yield client


def post_generation(client, body: bytes, ctype: str) -> tuple[int, str, dict]:
    """(status, reply content type, decoded reply) of one `POST /v1/actions/generations`."""
    resp = client.post(GENERATIONS, content=body, headers={"content-type": ctype})
    reply_type = resp.headers["content-type"]
    return resp.status_code, reply_type, decode(resp.content, codec.JSON if "json" in reply_type else codec.OPENPI)
