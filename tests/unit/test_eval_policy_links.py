"""Policy links: chunk validation, failure classification, wire mapping, and the OpenPI link against a fake server."""

import numpy as np
import pytest

from dreamzero.errors import ConfigError
from dreamzero_client.errors import PolicyServerError, ProtocolError, ReplyTimeout, ServerUnavailableError
from eval.policy_links import (
    FRAME_OFFSETS,
    HttpLink,
    OpenPILink,
    PolicyLinkError,
    classify_failure,
    make_policy_link,
    openpi_request,
    raw_observation,
    select_frames,
    validate_chunk,
)
from tests.eval_support import FakeOpenPIServer


def _frame(value: int = 0) -> dict:
    img = np.full((180, 320, 3), value, dtype=np.uint8)
    return {
        "exterior_image_0_left": img,
        "exterior_image_1_left": img + 1,
        "wrist_image_left": img + 2,
        "joint_position": np.arange(7, dtype=np.float64) * 0.1,
        "gripper_position": np.array([0.0]),
    }


def test_validate_chunk():
    assert validate_chunk(np.zeros((24, 8), np.float32)).shape == (24, 8)
    assert validate_chunk(np.zeros((1, 24, 8))).shape == (24, 8)  # a batch of one is unwrapped
    for bad, words in [
        (np.zeros((24, 7)), "expected [H, 8]"),
        (np.zeros(8), "shape [8]"),
        (np.full((24, 8), np.inf), "non-finite"),
        ("nope", "not numeric"),
    ]:
        with pytest.raises(PolicyLinkError) as err:
            validate_chunk(bad)
        assert err.value.reason == "bad_chunk" and words in str(err.value)


@pytest.mark.parametrize(
    "exc,reason",
    [
        (ServerUnavailableError("refused"), "server_unreachable"),
        (ConnectionRefusedError(), "server_unreachable"),
        (ReplyTimeout("slow"), "timeout"),
        (TimeoutError(), "timeout"),
        (PolicyServerError("Internal inference error"), "error_reply"),
        (ProtocolError("bad reply"), "bad_chunk"),
        (RuntimeError("anything else"), "error_reply"),
    ],
)
def test_classify_failure(exc, reason):
    assert classify_failure(exc) == reason


def test_frame_selection_and_raw_form():
    frames = [_frame(i) for i in range(30)]
    assert select_frames(frames, first_call=True) == [frames[-1]]
    picked = select_frames(frames, first_call=False)
    assert [f["exterior_image_0_left"][0, 0, 0] for f in picked] == [29 + off for off in FRAME_OFFSETS]
    early = select_frames(frames[:5], first_call=False)  # clamped to the episode's first frame
    assert [f["exterior_image_0_left"][0, 0, 0] for f in early] == [0, 0, 0, 4]
    raw = raw_observation(picked)
    assert raw["video.exterior_image_1_left"].shape == (1, 4, 180, 320, 3)
    assert raw["video.exterior_image_2_left"][0, 0, 0, 0, 0] == picked[0]["exterior_image_1_left"][0, 0, 0]
    assert raw["state.joint_position"].shape == (1, 1, 7) and raw["state.gripper_position"].shape == (1, 1, 1)


def test_openpi_request_keys():
    msg = openpi_request(_frame(), "put the cube in the bowl", "ep-1")
    assert msg["prompt"] == "put the cube in the bowl" and msg["session_id"] == "ep-1"
    assert msg["observation/cartesian_position"].shape == (6,)
    assert msg["observation/joint_position"].dtype == np.float32


def test_openpi_link_round_trip_and_injected_failures():
    with FakeOpenPIServer(error_at=(2,), bad_chunk_at=(3,)) as server:
        link = OpenPILink("127.0.0.1", server.port, timeout_s=5)
        try:
            reply = link.infer([_frame()], "put the cube in the bowl", "ep-1")
            assert reply.actions.shape == (24, 8) and reply.latency_s > 0
            np.testing.assert_allclose(reply.actions[0, :7], np.arange(7) * 0.1 + 0.01, atol=1e-6)
            assert link.server_metadata["image_resolution"] == [180, 320]
            with pytest.raises(PolicyLinkError) as err:
                link.infer([_frame()], "put the cube in the bowl", "ep-1")
            assert err.value.reason == "error_reply" and "Internal inference error" in str(err.value)
            with pytest.raises(PolicyLinkError) as err:
                link.infer([_frame()], "put the cube in the bowl", "ep-1")
            assert err.value.reason == "bad_chunk"
            link.reset("ep-1")
            assert server.resets == ["ep-1"]
            assert server.requests[0]["session_id"] == "ep-1"
        finally:
            link.close()


def test_openpi_link_accepts_bare_array_replies():
    with FakeOpenPIServer(reply_as_dict=False) as server:
        link = OpenPILink("127.0.0.1", server.port, timeout_s=5)
        try:
            assert link.infer([_frame()], "x", "s").actions.shape == (24, 8)
        finally:
            link.close()


def test_openpi_link_reports_an_absent_server():
    with FakeOpenPIServer() as server:
        port = server.port
    link = OpenPILink("127.0.0.1", port, timeout_s=2, max_reconnects=0)
    with pytest.raises(PolicyLinkError) as err:
        link.infer([_frame()], "x", "s")
    assert err.value.reason == "server_unreachable"
    link.reset("s")  # nothing connected: a no-op, not an error
    link.close()


class _FakeActionClient:
    def __init__(self):
        self.calls, self.forgotten = [], []

    def generate(self, observation, prompts, session_ids, form="raw"):
        self.calls.append({k: v.shape for k, v in observation.items()})
        from types import SimpleNamespace

        return SimpleNamespace(
            actions=np.zeros((1, 24, 8), np.float32),
            timings={"total": 3.0},
            sessions=[{"session_id": session_ids[0], "step": len(self.calls)}],
        )

    def forget_sessions(self, ids):
        self.forgotten.extend(ids)


def test_http_link_sends_one_frame_then_four_and_forgets_the_session():
    client = _FakeActionClient()
    link = HttpLink(client=client)
    frames = [_frame(i) for i in range(9)]
    first = link.infer(frames[:1], "task", "ep-9")
    link.infer(frames, "task", "ep-9")
    assert client.calls[0]["video.wrist_image_left"] == (1, 1, 180, 320, 3)
    assert client.calls[1]["video.wrist_image_left"] == (1, 4, 180, 320, 3)
    assert first.session == {"session_id": "ep-9", "step": 1} and first.server_timings_ms == {"total": 3.0}
    link.reset("ep-9")
    assert client.forgotten == ["ep-9"]
    link.infer(frames, "task", "ep-9")  # after a reset the next call is a first call again
    assert client.calls[2]["video.wrist_image_left"] == (1, 1, 180, 320, 3)


def test_make_policy_link_rejects_unknown_kinds():
    with pytest.raises(ConfigError, match="openpi"):
        make_policy_link("grpc")
