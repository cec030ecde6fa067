"""The HTTP client against the server's own request parser: a body the parser refuses reaches the client as a
`BadRequestError` naming the field. (tests/unit/client/test_http_client.py runs the client alone, without the
server.)"""

from __future__ import annotations

import numpy as np
import pytest

from deployments.requests.generations import parse_generation_request
from dreamzero_client.errors import BadRequestError
from tests.support.action_server import FakeActionServer, action_client


@pytest.fixture
def server():
    s = FakeActionServer(check=parse_generation_request)
    yield s
    s.stop()


def test_real_parser_error_reaches_client_with_field(server):
    with action_client(server) as client, pytest.raises(BadRequestError) as info:
        client.generate({"state.joint_position": np.ones((2, 1, 7))}, "pick", "x")
    assert info.value.field == "input.observation.state.joint_position" and "leading batch" in info.value.message


def test_a_body_the_parser_accepts_gets_its_chunk(server):
    obs = {
        "video.exterior_image_1_left": np.zeros((1, 1, 4, 4, 3), np.uint8),
        "state.joint_position": np.ones((1, 1, 7)),
    }
    with action_client(server) as client:
        assert client.generate(obs, "pick", "x").actions.shape[0] == 1
    assert len(server.posts()) == 1
