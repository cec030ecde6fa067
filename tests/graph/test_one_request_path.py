"""One request path behind every front door (docs/architecture.md): a request sent through the HTTP door (both
forms), the OpenPI WebSocket and the ZeroMQ door reaches the policy through the one `GraphRunner.run` of the door's
replica, and no door module calls the graph's stages itself. In-process (no Ray): the real ingress, doors,
preprocess and postprocess; the policy is a stand-in that records the batches it is given."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments.doors.zmq import ZmqDoor
from deployments.ingress import IngressDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from dreamzero_client.wire import codec, openpi, rldx
from serve_graph.builder import ingress_settings, zmq_door_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.ingress import RecordingPolicy
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import LocalHandle, normalised_body, raw_body
from tests.support.rldx import droid_rldx_observation

ROOT = Path(__file__).resolve().parents[2]
GEN = "/v1/actions/generations"
#: what only the runner calls: the stages, the policy's routed call and the transport choice
GRAPH_STEPS = {"policy_generate", "sticky_call", "RawStages", "preprocess_request", "normalised_batch", "Transport"}


@pytest.fixture(scope="module")
def doors():
    cfg = parse_app_args({"zmq": {"port": 5555, "host": "127.0.0.1"}})  # the door object only: nothing binds
    model = resolve_model(cfg)
    policy = RecordingPolicy()
    handles = [LocalHandle(s) for s in (PreprocessDeployment(), policy, PostprocessDeployment())]
    ingress = IngressDeployment(*handles, ingress_settings(cfg, model))
    runner = ingress.runner
    runs: list[str] = []
    real_run = runner.run

    async def counted_run(*args, **kwargs):
        runs.append(type(args[0]).__name__ if args else "")
        return await real_run(*args, **kwargs)

    runner.run = counted_run  # the doors look `run` up on their runner at every request
    zmq = ZmqDoor(runner, zmq_door_settings(cfg, model))
    with TestClient(ingress.__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
        yield SimpleNamespace(client=client, zmq=zmq, policy=policy, runs=runs, ingress=ingress)


def through(doors, send) -> int:
    """Rows the policy saw for one request sent by `send()`, which reached it through exactly one runner call."""
    runs, batches = len(doors.runs), len(doors.policy.batches)
    send()
    assert len(doors.runs) == runs + 1, "the request did not go through GraphRunner.run"
    assert len(doors.policy.batches) == batches + 1, "the policy was called other than once"
    return len(doors.policy.batches[-1])


def test_every_door_reaches_the_policy_through_the_one_runner(doors):
    def http(body):
        resp = doors.client.post(GEN, content=body, headers={"content-type": codec.MSGPACK_CONTENT_TYPE})
        assert resp.status_code == 200, resp.content[:300]

    assert through(doors, lambda: http(raw_body(["h-raw-0", "h-raw-1"]))) == 2
    assert through(doors, lambda: http(normalised_body(["h-norm"]))) == 1

    def websocket():
        with doors.client.websocket_connect("/v1/realtime/robot/openpi") as ws:
            openpi.unpack_frame(ws.receive_bytes())  # the handshake
            ws.send_bytes(openpi.pack_frame(openpi_droid_observation(0, "ws")))
            assert openpi.unpack_frame(ws.receive_bytes())[0].shape == (24, 8)

    assert through(doors, websocket) == 1

    def zmq():
        opts = {"session_ids": ["z0", "z1"]}
        msg = {"endpoint": "get_action", "data": {"observation": droid_rldx_observation(2, seed=3), "options": opts}}
        action, _ = rldx.unpack(asyncio.run(doors.zmq.handle(b"client-1", rldx.pack(msg))))
        assert all(np.shape(v)[0] == 2 for v in action.values())

    assert through(doors, zmq) == 2
    assert set(doors.runs) == {"GenerationRequest"}  # each door decoded its wire into the one request type


def test_no_door_calls_the_graphs_steps_itself():
    """The sequence preprocess -> policy -> postprocess lives in the runner only: no door module names its steps."""
    named = {}
    for path in sorted((ROOT / "deployments" / "doors").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        named[path.name] = sorted(names & GRAPH_STEPS)
    assert set(named) >= {"http.py", "openpi_ws.py", "zmq.py"}
    assert all(found == [] for found in named.values()), named
    runner = ast.parse((ROOT / "deployments" / "graph_runner.py").read_text())
    runner_names = {n.id for n in ast.walk(runner) if isinstance(n, ast.Name)}
    assert {"policy_generate", "RawStages", "normalised_batch"} <= runner_names  # the check reads real names
