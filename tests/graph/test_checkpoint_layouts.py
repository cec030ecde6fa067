"""The graph serves a checkpoint in each layout (hf folder, full_weights.pt + preset, -Diffusers folder): one tiny
model written three ways answers the same raw request with the same robot actions."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero_client.wire import codec
from tests.support.checkpoints import write_tiny_layouts
from tests.support.request_builders import GRAPH_ARGS, content_type, post_generation, raw_body, served_over_http

PRESET = {"hf": None, "full_weights": "tiny", "diffusers": None}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return write_tiny_layouts(tmp_path_factory.mktemp("served"))


@pytest.mark.slow
def test_each_layout_serves_the_same_actions(layouts):
    actions = {}
    for layout, path in layouts.items():
        args = {**GRAPH_ARGS, "model_path": str(path), "checkpoint_config": PRESET[layout]}
        with served_over_http(args, f"layout-{layout}") as graph:
            status, _, resp = post_generation(graph, raw_body(["s-0"], seed=7), content_type(codec.OPENPI))
            assert status == 200, resp
            actions[layout] = np.asarray(resp["data"][0]["action"]["values"], np.float32)
            assert actions[layout].shape == (1, 24, 8), layout
            assert graph.get("/v1/actions/metadata").json()["config"] == "tiny"
    np.testing.assert_allclose(actions["full_weights"], actions["hf"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(actions["diffusers"], actions["hf"], rtol=0, atol=1e-5)
