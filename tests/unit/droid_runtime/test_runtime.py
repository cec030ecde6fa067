"""The DROID client runtime: observation builder, frame history, chunk check, gripper rule, continuity, links."""

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from deployments.requests.openpi import parse_openpi_request
from dreamzero_client.errors import (
    ConfigError,
    InvalidObservation,
    PolicyServerError,
    ProtocolError,
    ReplyTimeout,
    ServerUnavailableError,
)
from dreamzero_client.wire import openpi
from dreamzero_droid import droid
from dreamzero_droid.links import HttpLink, OpenPILink, connect
from dreamzero_droid.policy import (
    ChunkRejected,
    DroidPolicy,
    PolicyCallError,
    classify_failure,
    validate_chunk,
)
from tests.support.evaluation import RecordingLink
from tests.support.observations import droid_runtime_observation


def droid_obs(value: int = 0, hw=(360, 640), prompt: str | None = None) -> dict:
    """The runtime's observation at a camera's own size (the runtime resizes it), gripper part closed."""
    return droid_runtime_observation(value, hw, gripper=0.25, prompt=prompt)


# 1. Observation builder and frame history ---------------------------------------------------------------------------
def test_make_frame_resizes_every_camera_and_names_bad_fields():
    frame = droid.make_frame(droid_obs(10))
    assert {k: v.shape for k, v in frame.images.items()} == {c: (180, 320, 3) for c in droid.CAMERAS}
    assert frame.images["wrist_image_left"][0, 0, 0] == 12 and frame.joint_position.dtype == np.float32
    bad = droid_obs()
    del bad["wrist_image_left"]
    with pytest.raises(InvalidObservation, match="observation.wrist_image_left: missing") as err:
        droid.make_frame(bad)
    assert err.value.field == "wrist_image_left"
    with pytest.raises(InvalidObservation, match="joint_position: expected 7 finite numbers"):
        droid.make_frame({**droid_obs(), "joint_position": np.zeros(6)})
    with pytest.raises(InvalidObservation, match="observation.exterior_image_0_left"):
        droid.make_frame({**droid_obs(), "exterior_image_0_left": np.zeros((10, 10, 3), np.float32)})


def test_history_sends_one_frame_first_then_four_at_the_reference_offsets():
    history = droid.FrameHistory()
    for step in range(40):
        history.append(droid.make_frame(droid_obs(step % 200, hw=(180, 320))))
    assert len(history) == droid.HISTORY_LEN == 24
    assert [f.images["exterior_image_0_left"][0, 0, 0] for f in history.select(True)] == [39]
    picked = history.select(False)
    assert [f.images["exterior_image_0_left"][0, 0, 0] for f in picked] == [39 - 23, 39 - 16, 39 - 8, 39]
    early = droid.FrameHistory()
    for step in range(5):
        early.append(droid.make_frame(droid_obs(step, hw=(180, 320))))
    assert [f.images["exterior_image_0_left"][0, 0, 0] for f in early.select(False)] == [0, 0, 0, 4]


def test_raw_and_openpi_forms_use_the_one_key_map():
    frames = [droid.make_frame(droid_obs(v, hw=(180, 320))) for v in (0, 1, 2, 3)]
    raw = droid.raw_observation(frames)
    assert set(raw) == set(droid.OPENPI_DROID_KEY_MAP.values())
    assert raw["video.exterior_image_1_left"].shape == (1, 4, 180, 320, 3)
    assert raw["video.exterior_image_2_left"][0, :, 0, 0, 0].tolist() == [1, 2, 3, 4]  # exterior 1 -> raw "2"
    assert raw["state.joint_position"].shape == (1, 7) and raw["state.gripper_position"].tolist() == [[0.25]]
    single = droid.openpi_observation(frames[-1:])
    assert single["observation/wrist_image_left"].shape == (180, 320, 3)
    assert openpi.OPENPI_DROID_KEY_MAP is droid.OPENPI_DROID_KEY_MAP  # the server's adapter reads the same map


def test_gripper_rule():
    assert droid.binarize_gripper(0.51) == 1.0 and droid.binarize_gripper(1.0) == 1.0
    assert droid.binarize_gripper(0.5) == 0.0 and droid.binarize_gripper(-1.0) == 0.0
    assert droid.binarize_gripper(0.3, threshold=0.2) == 1.0


# 2. Chunk check and failure reasons ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "chunk,message",
    [
        (np.zeros((24, 7)), r"shape \(H, 8\)"),
        (np.zeros(8), r"shape \(H, 8\)"),
        (np.zeros((4, 8)), "at least 8 rows"),
        (np.array([["a"] * 8] * 8), "real numeric array"),
        ("nope", "real numeric array, got str"),
        (None, "real numeric array, got NoneType"),
        (np.zeros((24, 8), dtype=complex), "got dtype complex128"),
        (np.zeros((24, 8), dtype=object), "got dtype object"),
        (np.zeros((24, 8, 1)), r"shape \(H, 8\)"),
    ],
)
def test_validate_chunk_rejects_bad_chunks(chunk, message):
    with pytest.raises(ChunkRejected, match=message) as err:
        validate_chunk(chunk, min_rows=8)
    assert err.value.reason == "bad_chunk" and isinstance(err.value, PolicyCallError)


def test_validate_chunk_unwraps_a_batch_of_one_and_names_the_first_nan():
    assert validate_chunk(np.zeros((1, 24, 8), np.float32)).dtype == np.float64
    chunk = np.zeros((24, 8))
    chunk[5, 3] = np.nan
    with pytest.raises(ChunkRejected, match="row 5, column 3"):
        validate_chunk(chunk)


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


# 3. The policy: sessions, history, continuity -------------------------------------------------------------------------
def test_policy_queries_with_history_and_echoes_the_last_reply():
    reports = [
        {"session_id": "x", "step": 1, "incarnation": "inc-a", "restarted": True, "restart_reason": "new_session"},
        {"session_id": "x", "step": 2, "incarnation": "inc-a", "restarted": False},
    ]
    link = RecordingLink(reports)
    policy = DroidPolicy(link, prompt="wipe the table")
    first = policy.infer(droid_obs(0))
    for step in range(1, 8):
        policy.observe(droid_obs(step))
    second = policy.infer(droid_obs(8, prompt="wipe the table again"))
    q1, q2 = link.queries
    assert q1.first_call and len(q1.frames) == 1 and q1.expected_step is None and q1.prompt == "wipe the table"
    assert not q2.first_call and [f.images["exterior_image_0_left"][0, 0, 0] for f in q2.frames] == [0, 0, 0, 8]
    assert (q2.expected_step, q2.expected_incarnation, q2.prompt) == (1, "inc-a", "wipe the table again")
    assert first.restarted is None and second.restarted is None and second.actions.shape == (24, 8)
    assert first.session_id == q1.session_id == q2.session_id and first.timings == {"total": 1.0}


def test_a_restart_the_client_did_not_ask_for_is_flagged():
    reports = [
        {"step": 1, "incarnation": "a", "restarted": True, "restart_reason": "new_session"},
        {"step": 1, "incarnation": "b", "restarted": True, "restart_reason": "step_mismatch"},
    ]
    policy = DroidPolicy(RecordingLink(reports), prompt="p")
    policy.infer(droid_obs())
    assert policy.infer(droid_obs()).restarted == "step_mismatch"


def test_reset_releases_a_used_session_and_starts_a_new_one():
    link = RecordingLink()
    policy = DroidPolicy(link, prompt="p", session_prefix="franka")
    unused = policy.session_id
    policy.reset()
    assert link.resets == [] and policy.session_id != unused  # nothing to release on the server
    used = policy.session_id
    policy.infer(droid_obs())
    policy.reset()
    assert link.resets == [used] and policy.session_id.startswith("franka-") and len(policy.history) == 0
    policy.infer(droid_obs())
    assert link.queries[-1].first_call and link.queries[-1].expected_step is None


def test_failures_become_policy_call_errors_with_reasons():
    class Broken(RecordingLink):
        def send(self, query):
            raise ServerUnavailableError("connection refused")

    with pytest.raises(PolicyCallError) as err:
        DroidPolicy(Broken(), prompt="p").infer(droid_obs())
    assert err.value.reason == "server_unreachable"
    with pytest.raises(ChunkRejected, match="at least 8 rows"):
        DroidPolicy(RecordingLink(actions=np.zeros((4, 8))), prompt="p", min_rows=8).infer(droid_obs())
    with pytest.raises(InvalidObservation, match="prompt"):
        DroidPolicy(RecordingLink()).infer(droid_obs())  # no prompt anywhere
    with pytest.raises(InvalidObservation, match="prompt"):
        DroidPolicy(RecordingLink(), prompt="  ")


# 4. Links -----------------------------------------------------------------------------------------------------------
def test_openpi_message_carries_the_stack_and_the_continuity_fields():
    link = RecordingLink([{"step": 4, "incarnation": "inc"}])
    policy = DroidPolicy(link, prompt="p")
    policy.infer(droid_obs())
    query = policy.request(droid_obs())
    msg = OpenPILink().message(query)
    assert msg["observation/exterior_image_0_left"].shape == (4, 180, 320, 3)
    assert msg["observation/cartesian_position"].shape == (6,) and msg["response_format"] == "dict"
    assert msg["expected_steps"] == [4] and msg["expected_incarnations"] == ["inc"]
    parsed = parse_openpi_request(openpi.unpack_frame(openpi.pack_frame(msg))[0])
    assert (parsed.rows.expected_steps, parsed.rows.expected_incarnations) == ([4], ["inc"])
    assert "expected_steps" not in parsed.observation
    first = OpenPILink().message(DroidPolicy(RecordingLink(), prompt="p").request(droid_obs()))
    assert first["observation/wrist_image_left"].shape == (180, 320, 3) and "expected_steps" not in first


def test_http_link_sends_the_raw_form_and_the_continuity_fields():
    calls = []

    class FakeActionClient:
        def generate(self, observation, prompt, session_id, form, expected_steps, expected_incarnations):
            calls.append((observation, prompt, session_id, form, expected_steps, expected_incarnations))
            report = {"session_id": session_id, "step": len(calls), "incarnation": "i"}
            return SimpleNamespace(actions=np.ones((1, 24, 8), np.float32), sessions=[report], timings={"t": 1.0})

        def forget_sessions(self, ids):
            calls.append(("forget", ids))

    policy = DroidPolicy(HttpLink(client=FakeActionClient()), prompt="open the drawer")
    sid = policy.session_id
    policy.infer(droid_obs())
    policy.infer(droid_obs())
    (obs1, prompt, session, form, steps1, _), (obs2, *_, steps2, inc2) = calls
    assert (prompt, session, form, steps1) == ("open the drawer", sid, "raw", [None])
    assert obs1["video.wrist_image_left"].shape == (1, 1, 180, 320, 3)
    assert obs2["video.wrist_image_left"].shape == (1, 4, 180, 320, 3) and (steps2, inc2) == ([1], ["i"])
    policy.reset()
    assert calls[-1] == ("forget", [sid])


def test_connect_picks_the_link_by_scheme():
    assert isinstance(connect("ws://robot:8000"), OpenPILink) and isinstance(connect("wss://robot"), OpenPILink)
    with pytest.raises(ConfigError, match="server: expected a ws://"):
        connect("tcp://robot:1")


def test_the_runtime_stays_light():
    import subprocess

    code = (
        "import sys, dreamzero_droid.policy, dreamzero_droid.links, dreamzero_droid.droid;"
        "print([m for m in ('PIL', 'torch', 'ray', 'cv2') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
