"""A serving graph in Ray Serve's local testing mode (in-process, no routers) with the embedded tiny model, reached over
its HTTP door in-process."""

from __future__ import annotations

import pytest

GRAPH_ARGS = {
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 8},
}


@pytest.fixture(scope="module")
def graph():
    """An HTTP client of the graph (tests.support.request_builders.served_over_http)."""
    from tests.support.request_builders import served_over_http

    with served_over_http(GRAPH_ARGS, "graph-test") as client:
        yield client
