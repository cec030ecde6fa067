"""The raw form answers the same wherever its transforms run: in the front door or on the Preprocess / Postprocess
replicas (`preprocess.placement`, `postprocess.placement`), including the session continuity and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero_client.wire import codec
from tests.support.request_builders import GRAPH_ARGS, post_generation, raw_body, served_over_http

PLACEMENTS = {
    "front-door": {"preprocess": {"placement": "ingress"}, "postprocess": {"placement": "ingress"}},
    "replicas": {"preprocess": {"placement": "replicas"}, "postprocess": {"placement": "replicas"}},
}


@pytest.fixture(scope="module")
def apps():
    with (
        served_over_http({**GRAPH_ARGS, **PLACEMENTS["front-door"]}, "placement-front-door") as front,
        served_over_http({**GRAPH_ARGS, **PLACEMENTS["replicas"]}, "placement-replicas") as replicas,
    ):
        yield {"front-door": front, "replicas": replicas}


def generate(app, body: bytes):
    status, _, reply = post_generation(app, body, codec.content_type_for(codec.OPENPI))
    assert status == 200, reply
    return reply


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
    from dreamzero_client.wire import generations
    from tests.support.request_builders import droid_raw_observation

    obs = droid_raw_observation(1, 1)
    obs["video.exterior_image_2_left"] = obs["video.exterior_image_2_left"][..., :2]  # two colour channels
    body = codec.encode_body(generations.build_request_body(obs, ["pick"], ["bad"]), codec.OPENPI)[0]
    for app in apps.values():
        status, _, reply = post_generation(app, body, codec.content_type_for(codec.OPENPI))
        err = reply["error"]
        assert status == 422 and "video.exterior_image_2_left" in (err.get("field") or err["message"])
