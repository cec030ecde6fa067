"""The raw form answers the same wherever its transforms run: in the front door or on the Preprocess / Postprocess
replicas (`preprocess.placement`, `postprocess.placement`), including the session continuity and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero_client.wire import codec
from tests.graph.conftest import GRAPH_ARGS
from tests.graph.helpers import decode, raw_body

TIMEOUT_S = 120
PLACEMENTS = {
    "front-door": {"preprocess": {"placement": "ingress"}, "postprocess": {"placement": "ingress"}},
    "replicas": {"preprocess": {"placement": "replicas"}, "postprocess": {"placement": "replicas"}},
}


@pytest.fixture(scope="module")
def apps():
    from ray import serve

    from serve_graph.builder import build_app

    return {
        name: serve.run(build_app({**GRAPH_ARGS, **extra}), name=f"placement-{name}", _local_testing_mode=True)
        for name, extra in PLACEMENTS.items()
    }


def generate(app, body: bytes):
    payload, _ = app.generate.remote(body, codec.content_type_for(codec.OPENPI)).result(timeout_s=TIMEOUT_S)
    return decode(payload)


def test_both_placements_give_the_same_actions_and_sessions(apps):
    replies = {}
    for name, app in apps.items():
        first = generate(app, raw_body(["same"], t=1))
        second = generate(app, raw_body(["same"], t=4, expected_steps=[first["sessions"][0]["step"]]))
        replies[name] = (first, second)
    (a1, a2), (b1, b2) = replies["front-door"], replies["replicas"]
    for a, b in ((a1, b1), (a2, b2)):
        assert np.array_equal(a["data"][0]["action"]["values"], b["data"][0]["action"]["values"])
        assert a["sessions"][0]["step"] == b["sessions"][0]["step"]
        assert a["sessions"][0]["restart_reason"] == b["sessions"][0]["restart_reason"]
    assert a2["sessions"][0]["restarted"] is False  # the second call continued the session in both
    assert {"preprocess", "postprocess"} <= set(a2["timings"]) and {"preprocess", "postprocess"} <= set(b2["timings"])


def test_a_bad_camera_is_the_same_named_error_in_both(apps):
    from deployments.error_replies import classify
    from dreamzero_client.wire import generations
    from tests.graph.helpers import droid_raw_observation

    obs = droid_raw_observation(1, 1)
    obs["video.exterior_image_2_left"] = obs["video.exterior_image_2_left"][..., :2]  # two colour channels
    body = codec.encode_body(generations.build_request_body(obs, ["pick"], ["bad"]), codec.OPENPI)[0]
    for app in apps.values():
        with pytest.raises(Exception) as info:  # the ingress raises; the table maps it
            generate(app, body)
        reply = classify(info.value)
        assert reply.status == 422 and "video.exterior_image_2_left" in (reply.field or reply.message)
