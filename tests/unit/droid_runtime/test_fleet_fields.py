"""The fleet's per-row fields of a query (observed_at, traffic_class, deadline_ms) on both links, read back by the
server's own decoders; a query that sets none sends today's message."""

from __future__ import annotations

import httpx
import numpy as np

from deployments.requests.generations import parse_generation_request
from deployments.requests.openpi import parse_openpi_request
from deployments.requests.replies import build_response
from dreamzero_client.http_client import ActionClient
from dreamzero_client.wire import codec, openpi
from dreamzero_droid.links import FLEET_FIELDS, HttpLink, OpenPILink
from dreamzero_droid.policy import DroidPolicy
from tests.support.observations import droid_runtime_observation

FIELDS = {"observed_at": 1700000000.25, "traffic_class": "realtime", "deadline_ms": 400.0}


def test_openpi_message_carries_the_fields_only_when_set():
    policy = DroidPolicy(OpenPILink(), prompt="p")
    plain = OpenPILink().message(policy.request(droid_runtime_observation()))
    assert not set(FLEET_FIELDS) & set(plain)
    msg = OpenPILink().message(policy.request(droid_runtime_observation(), **FIELDS))
    rows = parse_openpi_request(openpi.unpack_frame(openpi.pack_frame(msg))[0]).rows
    assert rows.observed_at == [FIELDS["observed_at"]] and rows.traffic_class == ["realtime"]
    assert rows.deadline_ms == [400.0]


def test_http_link_sends_them_in_parameters_and_reads_the_echo():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        body, flavour = codec.decode_body(request.content, request.headers["content-type"])
        bodies.append(body)
        req = parse_generation_request(body, flavour)
        session = {"session_id": req.session_ids[0], "step": 1, "restarted": False, "restart_reason": None,
                   "frame_position": 0, "incarnation": "x"}  # fmt: skip
        data, ctype = codec.encode_body(build_response(req, np.zeros((1, 24, 8)), [session]), flavour)
        return httpx.Response(200, content=data, headers={"Content-Type": ctype})

    client = ActionClient("http://127.0.0.1:9", max_retries=0)
    client._http = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(handler))
    policy = DroidPolicy(HttpLink(client=client), prompt="p")
    policy.infer(droid_runtime_observation())
    policy.send(policy.request(droid_runtime_observation(), **FIELDS))
    assert not set(FLEET_FIELDS) & set(bodies[0]["parameters"])
    rows = parse_generation_request(bodies[1], "json").rows
    assert rows.observed_at == [FIELDS["observed_at"]] and rows.traffic_class == ["realtime"]
    assert rows.deadline_ms == [400.0]


def test_a_late_reply_of_an_older_query_does_not_set_the_continuity_fields():
    from tests.support.evaluation import RecordingLink

    link = RecordingLink([{"step": 1, "incarnation": "a"}, {"step": 3, "incarnation": "a"}, {"step": 2}])
    policy = DroidPolicy(link, prompt="p")
    policy.infer(droid_runtime_observation())
    abandoned = policy.request(droid_runtime_observation())  # its reply comes after the next query's
    newer = policy.request(droid_runtime_observation())
    assert (abandoned.seq, newer.seq) == (2, 3)
    policy.send(newer)  # step 3
    policy.send(abandoned)  # step 2, late: ignored
    assert policy.request(droid_runtime_observation()).expected_step == 3
