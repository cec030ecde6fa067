"""A serving graph in Ray Serve's local testing mode (in-process, no HTTP, no routers): fast graph-level checks."""

from __future__ import annotations

import importlib.util

import pytest

GRAPH_ARGS = {
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 8},
}


def _real_model_available() -> bool:
    return all(importlib.util.find_spec(m) for m in ("dreamzero.checkpoint", "dreamzero.embedded_default"))


@pytest.fixture(scope="module")
def graph():
    from ray import serve

    from serve_graph.builder import build_app

    patch = None
    if not _real_model_available():  # interim: the embedded tiny model is not in the tree yet
        import deployments.policy as policy_mod
        from tests.graph.fake_pipeline import FakePipeline

        patch = pytest.MonkeyPatch()
        patch.setattr(policy_mod, "load_pipeline", lambda **kw: FakePipeline.load(**kw))
    try:
        yield serve.run(build_app(GRAPH_ARGS), name="graph-test", _local_testing_mode=True)
    finally:
        if patch is not None:
            patch.undo()
