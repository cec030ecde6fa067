"""A serving graph in Ray Serve's local testing mode (in-process, no HTTP, no routers) with the embedded tiny model."""

from __future__ import annotations

import pytest

GRAPH_ARGS = {
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 8},
}


@pytest.fixture(scope="module")
def graph():
    from ray import serve

    from serve_graph.builder import build_app

    return serve.run(build_app(GRAPH_ARGS), name="graph-test", _local_testing_mode=True)
