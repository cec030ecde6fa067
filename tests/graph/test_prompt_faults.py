"""A stuck or dead stage replica answers promptly: each Preprocess / Postprocess call is bounded by its own
`<stage>.call_timeout_s`, so the client gets a retryable 503 naming it instead of waiting for the trip's bound
(in-process ingress, the stage a stand-in that never answers; the cluster scenario: tests/cluster/test_faults.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from starlette.testclient import TestClient

from deployments.ingress import IngressDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from serve_graph.builder import ingress_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.ingress import MSGPACK, FakePolicy
from tests.support.request_builders import LocalHandle, decode, raw_body


class Stuck:
    """A stage replica's handle: the call is accepted and never answered (the replica died or is wedged)."""

    def options(self, **_):
        return self

    @property
    def run(self):
        return SimpleNamespace(remote=lambda *args: asyncio.sleep(3600))


def _door(stage: str):
    stages = {"preprocess": PreprocessDeployment(), "postprocess": PostprocessDeployment()}
    args = {stage: {"placement": "replicas", "call_timeout_s": 0.3}, "http": {"request_timeout_s": 300}}
    cfg = parse_app_args(args)
    handles = [LocalHandle(stages["preprocess"]), LocalHandle(FakePolicy()), LocalHandle(stages["postprocess"])]
    handles[0 if stage == "preprocess" else 2] = Stuck()
    return IngressDeployment(*handles, ingress_settings(cfg, resolve_model(cfg)))


def test_a_stuck_preprocess_or_postprocess_replica_is_a_prompt_503():
    for stage in ("preprocess", "postprocess"):
        with TestClient(_door(stage).__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
            resp = client.post("/v1/actions/generations", content=raw_body(["s"]), headers=MSGPACK)
        error = decode(resp.content)["error"]
        assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1, (stage, resp.content[:300])
        assert error["code"] == "no_capacity" and f"{stage}.call_timeout_s" in error["message"], error
