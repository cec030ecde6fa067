"""The ingress's FastAPI app in-process (Starlette's TestClient, no Ray) with the real Preprocess and Postprocess
classes and stand-in policies that record their batches (`FakePolicy`, `RecordingPolicy`), and `local_door`, which
the graph tier's `door` fixture opens (tests/graph/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
from starlette.testclient import TestClient

from deployments.ingress import IngressDeployment
from deployments.policy import PolicyOutput
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from dreamzero.types import ChunkResult, ModelBatch, SessionReport
from dreamzero_client.wire import codec
from serve_graph.builder import ingress_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.request_builders import LocalHandle

KEY = "front-door-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGPACK = {"content-type": codec.MSGPACK_CONTENT_TYPE}
GEN = "/v1/actions/generations"


class FakePolicy:
    """Zero actions; sessions continue (step + 1, same incarnation) unless the client's expectation differs."""

    def __init__(self):
        self.batches: list[ModelBatch] = []
        self.fail_with: BaseException | None = None
        self.steps: dict[str, tuple[int, str]] = {}

    def generate(self, batch: ModelBatch) -> PolicyOutput:
        self.batches.append(batch)
        if self.fail_with is not None:
            raise self.fail_with
        reports = []
        for sid in batch.session_ids:
            step, inc = self.steps.get(sid, (0, f"inc-{len(self.batches)}"))
            self.steps[sid] = (step + 1, inc)
            reports.append(SessionReport(sid, step + 1, step == 0, "new_session" if step == 0 else None, 1, inc))
        actions = np.zeros((len(batch), 24, 32), np.float32)
        return PolicyOutput(ChunkResult(actions=actions, sessions=reports), "fake-replica")

    def info(self) -> dict:
        return {
            "config_name": "tiny", "action_horizon": 24, "max_action_dim": 32, "max_state_dim": 64,
            "default_seed": 1140, "num_inference_steps": 2,
        }  # fmt: skip

    def ready(self) -> bool:
        if self.fail_with is not None:
            raise self.fail_with
        return True

    def drop_sessions(self, ids):
        return len(ids)


@contextmanager
def local_door(monkeypatch) -> Iterator[SimpleNamespace]:
    """(client, policy, ingress, counted): the ingress with key `KEY` and a 1 MiB body limit over a `FakePolicy`;
    `counted` lists the (status, form) of each request the HTTP door counted."""
    policy = FakePolicy()
    stages = (PreprocessDeployment(), policy, PostprocessDeployment())
    handles = [LocalHandle(stage) for stage in stages]
    cfg = parse_app_args({"api_key": KEY, "http": {"max_body_bytes": 1024 * 1024}})
    ingress = IngressDeployment(*handles, ingress_settings(cfg, resolve_model(cfg)))
    counted: list[tuple[int, str]] = []
    real_count = ingress.http.count

    def counted_call(tenant, status, code=None, **kw):  # the door's one count: note (status, form), then count
        counted.append((status, kw["form"]))
        real_count(tenant, status, code, **kw)

    monkeypatch.setattr(ingress.http, "count", counted_call)
    with TestClient(ingress.__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
        yield SimpleNamespace(client=client, policy=policy, ingress=ingress, counted=counted)


class RecordingPolicy:
    """A stand-in Policy deployment behind `LocalHandle`s: zero actions for every row; records each batch."""

    def __init__(self):
        self.batches: list[ModelBatch] = []

    def generate(self, batch: ModelBatch) -> PolicyOutput:
        self.batches.append(batch)
        reports = [SessionReport(sid, 1, True, "new_session", 1, "inc") for sid in batch.session_ids]
        return PolicyOutput(ChunkResult(np.zeros((len(batch), 24, 32), np.float32), reports), "recording-replica")

    def info(self) -> dict:
        return {"config_name": "tiny", "action_horizon": 24, "max_action_dim": 32, "max_state_dim": 64,
                "default_seed": 1140, "num_inference_steps": 2}  # fmt: skip

    def ready(self) -> bool:
        return True

    def drop_sessions(self, ids) -> int:
        return len(ids)

    def reset_sessions(self, ids) -> int:
        return len(ids)
