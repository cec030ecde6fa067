"""LIBERO eval adapter and runner without a server or LIBERO: flip, obs -> request, actions, success_once, failures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dreamzero.errors import ConfigError, InvalidObservation
from dreamzero_client.errors import BadRequestError, ServerUnavailableError
from eval.libero.adapter import (
    ChunkError,
    RequestCodec,
    flip_upright,
    frame_from_obs,
    frame_stack,
    quat_xyzw_to_axis_angle,
)
from eval.libero.cli import parse_index_ranges
from eval.libero.env import TaskInfo
from eval.libero.runner import plan_episodes, run_libero_evaluation
from tests.support.libero import MARKER, FakeBackend, FakeClient, libero_config, raw_image


def _obs(quat=(0.0, 0.0, 0.0, 1.0), pos=(0.1, 0.2, 0.3)) -> dict:
    return {
        "agentview_image": raw_image(10),
        "robot0_eye_in_hand_image": raw_image(100),
        "robot0_eef_pos": np.array(pos),
        "robot0_eef_quat": np.array(quat),
        "robot0_gripper_qpos": np.array([0.03, -0.03]),
        "robot0_joint_pos": np.zeros(7),
    }


# 1. Observation mapping ----------------------------------------------------------------------------------------------


def test_flip_turns_the_image_by_180_degrees():
    img = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    out = flip_upright(img)
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out[0, 0], img[1, 2])
    np.testing.assert_array_equal(out[1, 2], img[0, 0])
    np.testing.assert_array_equal(flip_upright(out), img)
    with pytest.raises(InvalidObservation, match="image"):
        flip_upright(np.zeros((4, 4)))


def test_axis_angle_from_xyzw_quaternion():
    np.testing.assert_allclose(quat_xyzw_to_axis_angle([0, 0, 0, 1]), [0, 0, 0])
    s = np.sin(np.pi / 4)
    np.testing.assert_allclose(quat_xyzw_to_axis_angle([0, 0, s, np.cos(np.pi / 4)]), [0, 0, np.pi / 2], atol=1e-12)
    np.testing.assert_allclose(quat_xyzw_to_axis_angle([1, 0, 0, 0]), [np.pi, 0, 0], atol=1e-12)
    with pytest.raises(InvalidObservation, match="robot0_eef_quat"):
        quat_xyzw_to_axis_angle([0, 0, 1])


def test_frame_from_obs_flips_both_views_and_builds_the_8_dim_state():
    frame = frame_from_obs(_obs())
    for img in (frame.image, frame.wrist_image):
        assert img[0, 0, 0] == MARKER and img[-1, -1, 0] != MARKER
    np.testing.assert_allclose(frame.state, [0.1, 0.2, 0.3, 0, 0, 0, 0.03, -0.03])
    bad = _obs()
    del bad["robot0_eye_in_hand_image"]
    with pytest.raises(InvalidObservation, match="robot0_eye_in_hand_image"):
        frame_from_obs(bad)


def test_raw_request_has_one_row_per_env():
    frames = [frame_from_obs(_obs(pos=(i, 0, 0))) for i in range(3)]
    prepared = RequestCodec("raw").build([[f] for f in frames], ["a", "b", "c"])
    obs = prepared.observation
    assert prepared.form == "raw" and prepared.prompts == ["a", "b", "c"] and prepared.negative_prompts is None
    assert obs["video.image"].shape == (3, 1, 16, 16, 3) and obs["video.image"].dtype == np.uint8
    assert obs["video.wrist_image"][1, 0, 0, 0, 0] == MARKER
    np.testing.assert_allclose(obs["state.state"][:, 0], [0, 1, 2])
    with pytest.raises(ValueError, match="instructions"):
        RequestCodec("raw").build([[f] for f in frames], ["a"])
    stacked = RequestCodec("raw").build([frames, frames[::-1]], ["a", "b"]).observation
    assert stacked["video.image"].shape == (2, 3, 16, 16, 3)
    np.testing.assert_allclose(stacked["state.state"][:, 0], [2, 0])  # the state is the current (last) frame's


def test_frame_stack_spans_the_last_chunk_and_pads_a_fresh_episode():
    history = [frame_from_obs(_obs(pos=(i, 0, 0))) for i in range(20)]
    assert [f.state[0] for f in frame_stack(history, 4)] == [4, 9, 14, 19]
    assert [f.state[0] for f in frame_stack(history[:3], 4)] == [0, 0, 0, 2]
    assert [f.state[0] for f in frame_stack(history[:1], 4)] == [0, 0, 0, 0]
    assert [f.state[0] for f in frame_stack(history, 1)] == [19]
    with pytest.raises(ConfigError, match="frame_stack"):
        frame_stack(history, 2)


def test_normalised_request_is_what_rlinf_sends():
    codec = RequestCodec("normalised")
    frames = [frame_from_obs(_obs()) for _ in range(2)]
    prepared = codec.build([[f] for f in frames], ["pick up the bowl", "open the drawer"])
    obs = prepared.observation
    assert prepared.form == "normalised"
    assert obs["images"].shape == (2, 1, 256, 512, 3) and obs["images"].dtype == np.uint8
    assert obs["state"].shape == (2, 1, 64) and obs["state"].dtype == np.float32
    assert obs["state_mask"][0, 0, :8].all() and not obs["state_mask"][0, 0, 8:].any()
    assert obs["embodiment_id"].tolist() == [21, 21]
    assert "pick up the bowl" in prepared.prompts[0] and prepared.prompts[0].startswith("A multi-view video")
    assert len(prepared.negative_prompts) == 2
    # the exterior view sits left, the wrist view right, both upright (marker at the top-left after crop + resize)
    assert obs["images"][0, 0, 0, 0, 0] > obs["images"][0, 0, -1, -1, 0]


# 2. Action mapping ---------------------------------------------------------------------------------------------------


def test_raw_actions_are_validated_and_clipped():
    codec = RequestCodec("raw")
    prepared = codec.build([[frame_from_obs(_obs())]] * 2, ["a", "b"])
    actions = np.zeros((2, 16, 7), dtype=np.float32)
    actions[0, 0, 0] = 3.0
    out = codec.actions(actions, prepared)
    assert out.shape == (2, 16, 7) and out.dtype == np.float64 and out[0, 0, 0] == 1.0
    with pytest.raises(ChunkError, match="B=2"):
        codec.actions(np.zeros((1, 16, 7)), prepared)
    with pytest.raises(ChunkError, match="7"):
        codec.actions(np.zeros((2, 16, 8)), prepared)
    actions[1, 3, 2] = np.nan
    with pytest.raises(ChunkError, match="non-finite"):
        codec.actions(actions, prepared)


def test_normalised_actions_are_unnormalised_with_the_gripper_binarised():
    codec = RequestCodec("normalised")
    prepared = codec.build([[frame_from_obs(_obs())]] * 2, ["a", "b"])
    reply = np.zeros((2, 16, 32), dtype=np.float32)
    reply[0, :, 6] = 0.9
    reply[1, :, 6] = -0.9
    out = codec.actions(reply, prepared)
    stats = codec.embodiment.metadata.stats("action.actions")
    mid = (np.asarray(stats.q01) + np.asarray(stats.q99)) / 2
    np.testing.assert_allclose(out[0, 0, :6], np.clip(mid[:6], -1, 1), atol=1e-6)
    assert out.shape == (2, 16, 7) and set(np.unique(out[:, :, 6])) <= {-1.0, 1.0}


# 3. Planning and CLI parsing -----------------------------------------------------------------------------------------


def test_plan_is_task_major_and_checks_indexes():
    tasks = [TaskInfo(0, "a", 3), TaskInfo(1, "b", 2)]
    assert [(t.task_id, i) for t, i in plan_episodes(tasks, None, None)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert [(t.task_id, i) for t, i in plan_episodes(tasks, [1], [1])] == [(1, 1)]
    with pytest.raises(ConfigError, match="task_ids"):
        plan_episodes(tasks, [5], None)
    with pytest.raises(ConfigError, match="init_states"):
        plan_episodes(tasks, None, [2])


def test_index_ranges():
    assert parse_index_ranges("all", "tasks") is None
    assert parse_index_ranges("0-2,7,1", "tasks") == (0, 1, 2, 7)
    for bad in ("2-1", "x", "-1"):
        with pytest.raises(ConfigError, match="--tasks"):
            parse_index_ranges(bad, "tasks")


# 4. The runner with fake envs and a fake client ----------------------------------------------------------------------


def test_b_envs_share_one_request_and_success_once_is_kept_per_task(tmp_path):
    client = FakeClient()
    summary = run_libero_evaluation(FakeBackend(num_init_states=2), client, libero_config(tmp_path))
    assert summary["episodes"] == 4 and summary["failed_episodes"] == 0
    assert summary["success_once"]["per_task"] == {0: 1.0, 1: 0.0} and summary["success_once"]["overall"] == 0.5
    first = client.calls[0]
    assert len(first["ids"]) == 3 and all(first["reset"])  # B = 3 rows in ONE request, new sessions reset
    for call in client.calls:  # each session is reset on its first call only
        assert len(set(call["ids"])) == len(call["ids"])
    seen: set[str] = set()
    for call in client.calls:
        for sid, reset in zip(call["ids"], call["reset"]):
            assert reset == (sid not in seen)
            seen.add(sid)
    assert summary["requests"] == len(client.calls) and {c["t"] for c in client.calls} == {4}  # raw: 4-frame stacks
    rec = json.loads((tmp_path / "episodes" / "task00_init001.json").read_text())
    assert rec["success_once"] and rec["success_step"] == 3 and rec["num_steps"] == 3
    assert [s["chunk_row"] for s in rec["steps"]] == [0, 1, 2] and len(rec["steps"][0]["action"]) == 7
    rec1 = json.loads((tmp_path / "episodes" / "task01_init000.json").read_text())
    assert not rec1["success"] and rec1["num_steps"] == 12 and rec1["server_calls"] == 3  # 12 steps / 4-row chunks
    assert sorted(client.forgotten) == sorted(seen)  # every finished session is dropped from the client's books
    from eval.report import write_report

    page = write_report(tmp_path).read_text()
    assert "LIBERO evaluation: 2/4 successful" in page


def test_a_hung_env_is_killed_recorded_and_the_run_finishes(tmp_path):
    backend = FakeBackend(num_init_states=2, hang=(1, 3))  # the env's 4th step: 1 settle step + episode step 2
    summary = run_libero_evaluation(backend, FakeClient(), libero_config(tmp_path, step_timeout_s=1.5))
    assert summary["episodes"] == 4
    failures = {(f["scene_id"], f["episode"]): f for f in summary["failures"]}
    assert set(failures) == {(1, 0), (1, 1)}
    assert all(f["reason"] == "env_timeout" and f["step"] == 2 for f in failures.values())
    assert summary["per_scene"][0]["successes"] == 2


def test_a_crashing_env_is_recorded_with_its_error(tmp_path):
    summary = run_libero_evaluation(
        FakeBackend(num_init_states=1, crash=(1, 0)), FakeClient(), libero_config(tmp_path, num_envs=2)
    )  # task 1 crashes in its settle step, while the episode starts
    (failure,) = summary["failures"]
    assert failure["reason"] == "env_error" and "MuJoCo instability" in failure["message"] and failure["step"] == 0
    assert summary["successes"] == 1


def test_a_failed_request_fails_its_rows_and_the_run_goes_on(tmp_path):
    client = FakeClient(fail_calls={1: ServerUnavailableError("connection refused"), 3: BadRequestError("bad", 422)})
    summary = run_libero_evaluation(FakeBackend(num_init_states=2), client, libero_config(tmp_path, num_envs=2))
    reasons = sorted((f["reason"], f["step"]) for f in summary["failures"])
    # call 1 (task 0's episodes) fails at once; call 2 starts task 1's episodes; call 3 fails them after one chunk
    assert reasons == [("error_reply", 4), ("error_reply", 4), ("server_unreachable", 0), ("server_unreachable", 0)]
    assert summary["episodes"] == 4 and summary["requests"] == 1  # failed requests are not timed as calls


def test_normalised_form_sends_one_frame_per_row_by_default(tmp_path):
    client = FakeClient()
    summary = run_libero_evaluation(FakeBackend(num_init_states=1), client, libero_config(tmp_path, form="normalised"))
    assert summary["episodes"] == 2 and summary["failed_episodes"] == 0, summary["failures"]
    assert {c["form"] for c in client.calls} == {"normalised"} and {c["t"] for c in client.calls} == {1}
    assert all(p.startswith("A multi-view video") for c in client.calls for p in c["prompts"])


def test_default_spawned_workers_run_an_episode(tmp_path):
    cfg = libero_config(
        tmp_path, num_envs=1, start_method="spawn", task_ids=(0,), init_states=(0,), reset_timeout_s=120
    )
    summary = run_libero_evaluation(FakeBackend(), FakeClient(), cfg)
    assert summary["successes"] == 1, summary["failures"]


def test_libero_options_compose_with_the_dreamzero_eval_parser(tmp_path):
    """`dreamzero-eval --sim libero` can reuse these options; shared ones (--max-steps, --seed, --out) stay its own."""
    from eval.cli import build_parser as droid_parser
    from eval.libero.cli import add_libero_arguments, build_parser, config_from_args

    p = droid_parser()
    add_libero_arguments(p)
    ns = p.parse_args(["--tasks", "1-2", "--init-states", "0", "--max-steps", "32", "--out", str(tmp_path)])
    config = config_from_args(ns)
    assert config.task_ids == (1, 2) and config.init_states == (0,) and config.max_steps == 32
    assert config.out_dir == tmp_path and config.frames_per_row == 4 and config.step_limit == 32
    own = build_parser().parse_args(["--form", "normalised", "--num-envs", "4"])
    config = config_from_args(own)
    assert config.form == "normalised" and config.num_envs == 4 and config.frames_per_row == 1
    assert config.step_limit == 220  # LIBERO-Spatial's published limit
    with pytest.raises(ConfigError, match="num_envs"):
        config_from_args(build_parser().parse_args(["--num-envs", "0"]))
