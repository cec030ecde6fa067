"""A 429 (the key's tenant over a quota) reaches every client as `QuotaExceededError` with the server's retry hint,
and is not retried by them (the robot loop decides whether to wait)."""

from __future__ import annotations

import pytest

from dreamzero_client.errors import PolicyServerError, QuotaExceededError, ServerError
from dreamzero_client.openpi_client import _error_from_frame
from dreamzero_client.wire import replies
from dreamzero_client.zmq_client import _server_error
from tests.support.action_server import FakeActionServer, action_client, small_observation


@pytest.fixture
def server():
    s = FakeActionServer()
    yield s
    s.stop()


def test_http_client_raises_quota_exceeded_with_retry_after_and_does_not_retry(server):
    message = "tenant 'eval' is over its rate of 2 requests/s (requests_per_s); retry after 0.40 s"
    server.script = [(429, {"Retry-After": "7"}, replies.error_body("quota_exceeded", message))] * 3
    with action_client(server, max_retries=3) as client:
        with pytest.raises(QuotaExceededError) as info:
            client.generate(small_observation(), "pick", "s")
    err = info.value
    assert (err.status, err.code, err.retry_after_s, err.message) == (429, "quota_exceeded", 7.0, message)
    assert len(server.posts()) == 1
    # without Retry-After (a request too large for the quota: waiting cannot help)
    server.script = [(429, {}, replies.error_body("quota_exceeded", "split it"))]
    with action_client(server) as client, pytest.raises(QuotaExceededError) as info:
        client.generate(small_observation(), "pick", "s")
    assert info.value.retry_after_s is None


def test_openpi_and_zmq_clients_read_the_retry_hint_of_a_429():
    frame = {"type": "error", "message": "over", "code": "quota_exceeded", "status": 429, "retry_after_s": 2.5}
    err = _error_from_frame(frame)
    assert isinstance(err, QuotaExceededError) and err.retry_after_s == 2.5 and err.code == "quota_exceeded"
    assert type(_error_from_frame({**frame, "status": 422})) is PolicyServerError
    reply = {"error": "over", "code": "quota_exceeded", "status": 429, "retry_after_s": 3}
    err = _server_error(reply)
    assert isinstance(err, QuotaExceededError) and isinstance(err, ServerError) and err.retry_after_s == 3
    assert _server_error({**reply, "retry_after_s": "soon"}).retry_after_s is None
