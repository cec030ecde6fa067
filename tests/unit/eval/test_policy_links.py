"""The evaluation's policies: the runtime's OpenPI link against a fake server (failures included) and make_policy."""

import numpy as np
import pytest

from dreamzero.errors import ConfigError
from dreamzero_droid.links import HttpLink, OpenPILink
from dreamzero_droid.policy import DroidPolicy, PolicyCallError
from eval.policy_links import make_policy
from tests.support.evaluation import FakeOpenPIServer
from tests.support.observations import droid_runtime_observation


def _obs(value: int = 0) -> dict:
    return droid_runtime_observation(value, prompt="put the cube in the bowl")


def _policy(port: int, **kwargs) -> DroidPolicy:
    return DroidPolicy(OpenPILink(f"ws://127.0.0.1:{port}", **kwargs))


def test_openpi_round_trip_and_injected_failures():
    with FakeOpenPIServer(error_at=(2,), bad_chunk_at=(3,)) as server:
        policy = _policy(server.port, timeout_s=5)
        try:
            chunk = policy.infer(_obs())
            assert chunk.actions.shape == (24, 8) and chunk.latency_ms > 0 and chunk.session["step"] == 1
            np.testing.assert_allclose(chunk.actions[0, :7], np.arange(7) * 0.1 + 0.01, atol=1e-6)
            assert policy.link.server_metadata["image_resolution"] == [180, 320]
            with pytest.raises(PolicyCallError) as err:
                policy.infer(_obs())
            assert err.value.reason == "error_reply" and "Internal inference error" in str(err.value)
            with pytest.raises(PolicyCallError) as err:
                policy.infer(_obs())
            assert err.value.reason == "bad_chunk"
            sid = policy.session_id
            policy.reset()
            assert server.resets == [sid] and server.requests[0]["session_id"] == sid
            assert server.frame_counts == [1, 4, 4]
        finally:
            policy.close()


def test_openpi_accepts_bare_array_replies():
    with FakeOpenPIServer(reply_as_dict=False) as server:
        with _policy(server.port, timeout_s=5) as policy:
            chunk = policy.infer(_obs())
    assert chunk.actions.shape == (24, 8) and chunk.session is None


def test_openpi_reports_an_absent_server():
    with FakeOpenPIServer() as server:
        port = server.port
    policy = _policy(port, timeout_s=2, max_reconnects=0)
    with pytest.raises(PolicyCallError) as err:
        policy.infer(_obs())
    assert err.value.reason == "server_unreachable"
    policy.reset()  # nothing connected: a no-op, not an error
    policy.close()


def test_make_policy_builds_each_link_and_rejects_unknown_kinds():
    policy = make_policy("openpi", url="ws://127.0.0.1:1")
    assert isinstance(policy.link, OpenPILink) and policy.session_id.startswith("droid-eval-")
    assert isinstance(make_policy("http", base_url="http://127.0.0.1:1").link, HttpLink)
    with pytest.raises(ConfigError, match="openpi"):
        make_policy("grpc")
