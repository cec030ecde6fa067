"""The evaluation runner on the MuJoCo scene: outputs, open-loop execution, sessions, and failures mid-run.

The OpenPI runs go over a real WebSocket to the fake server in tests/eval_support.py (the live `serve run` of the
tiny model is exercised in tests/e2e when the serve graph is available).
"""

import json

import imageio_ffmpeg
import numpy as np
import pytest

from dreamzero.errors import ConfigError
from dreamzero_client.links import OpenPILink
from dreamzero_client.policy import DroidPolicy
from eval.mujoco_droid import MujocoDroidEnv
from eval.report import write_report
from eval.runner import EvalConfig, run_evaluation
from tests.eval_support import FakeOpenPIServer, scripted_policy


def _env(scene):
    return MujocoDroidEnv(scene, image_size=(90, 160), render_quality="fast")


def test_short_run_over_openpi_websocket_writes_video_json_summary_report(tmp_path):
    with FakeOpenPIServer() as server:
        link = DroidPolicy(OpenPILink(f"ws://127.0.0.1:{server.port}", timeout_s=10))
        try:
            summary = run_evaluation(
                _env, link, EvalConfig(out_dir=tmp_path, max_steps=20, extra={"simulator": "mujoco"})
            )
        finally:
            link.close()
        assert server.infer_calls == 3  # steps 0, 8, 16
        assert server.frame_counts == [1, 4, 4]  # the first query starts the session, then 4-frame stacks
        assert "expected_steps" not in server.requests[0]  # the session's last reply goes back with the next query
        assert server.requests[1]["expected_steps"] == [1] and server.requests[2]["expected_incarnations"] == ["fake-1"]
        assert len(server.resets) == 1  # the session is reset after the episode
    assert summary["episodes"] == 1 and summary["server_calls"] == 3 and summary["failed_episodes"] == 0
    assert summary["latency_ms"]["count"] == 3 and summary["latency_ms"]["p50"] > 0
    assert summary["per_scene"][1]["ci95"][1] > 0.7  # one trial: a wide interval

    # video: 15 fps, three 180x320 views side by side, reset frame + one per step
    # (read back with imageio-ffmpeg: mediapy's reader passes -vsync, which the bundled ffmpeg 9 no longer has)
    reader = imageio_ffmpeg.read_frames(str(tmp_path / "videos" / "scene1_ep000.mp4"))
    meta = next(reader)
    frames = list(reader)
    assert meta["size"] == (960, 180) and meta["fps"] == pytest.approx(15.0)
    assert len(frames) == 21 and len(frames[0]) == 180 * 960 * 3

    record = json.loads((tmp_path / "episodes" / "scene1_ep000.json").read_text())
    steps = record["steps"]
    assert len(steps) == 20 and [s["step"] for s in steps if s["queried"]] == [0, 8, 16]
    assert steps[0]["chunk_latency_ms"] > 0 and steps[1]["chunk_latency_ms"] is None
    assert set(steps[0]) >= {
        "action",
        "joint_position",
        "gripper_position",
        "reward",
        "terminated",
        "truncated",
        "object_poses",
    }
    assert set(steps[0]["object_poses"]) == {"cube", "bowl"} and len(steps[0]["object_poses"]["cube"]) == 7
    assert steps[0]["raw_gripper"] == pytest.approx(0.8) and steps[0]["action"][7] == 1.0  # binarised
    # the chunk is executed open loop: row k of the chunk queried at step 0 is sent at step k
    q0 = np.asarray(server.requests[0]["observation/joint_position"], dtype=np.float64)
    np.testing.assert_allclose(steps[5]["action"][:7], q0 + 0.06, atol=1e-6)
    assert record["session_id"] == server.requests[0]["session_id"] and record["success"] is False

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["server_calls"] == 3 and (tmp_path / "summary.md").is_file()
    report = write_report(tmp_path).read_text()
    assert "videos/scene1_ep000.mp4" in report and "plots/latency_hist.png" in report
    for png in ("success_per_scene.png", "latency_hist.png", "joints_scene1_ep000.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000


def test_server_stopped_halfway_is_recorded_and_the_run_finishes(tmp_path):
    with FakeOpenPIServer(stop_after=2) as server:
        link = DroidPolicy(OpenPILink(f"ws://127.0.0.1:{server.port}", timeout_s=5, max_reconnects=0))
        try:
            config = EvalConfig(out_dir=tmp_path, episodes_per_scene=2, max_steps=24, record_video=False)
            summary = run_evaluation(_env, link, config)
        finally:
            link.close()
    assert summary["episodes"] == 2 and summary["failed_episodes"] == 2 and summary["successes"] == 0
    first, second = summary["failures"]
    assert first["reason"] == "server_unreachable" and first["step"] == 16  # third query: the server is gone
    assert second["reason"] == "server_unreachable" and second["step"] == 0
    assert summary["failure_reasons"] == {"server_unreachable": 2}
    record = json.loads((tmp_path / "episodes" / "scene1_ep000.json").read_text())
    assert record["failure"]["reason"] == "server_unreachable" and len(record["steps"]) == 16
    assert "server_unreachable" in write_report(tmp_path).read_text()


@pytest.mark.parametrize("inject,reason", [({"error_at": (2,)}, "error_reply"), ({"bad_chunk_at": (1,)}, "bad_chunk")])
def test_error_reply_or_bad_chunk_fails_only_that_episode(tmp_path, inject, reason):
    with FakeOpenPIServer(**inject) as server:
        link = DroidPolicy(OpenPILink(f"ws://127.0.0.1:{server.port}", timeout_s=5))
        try:
            summary = run_evaluation(
                _env, link, EvalConfig(out_dir=tmp_path, episodes_per_scene=2, max_steps=10, record_video=False)
            )
        finally:
            link.close()
        assert len(server.resets) == 2  # both sessions were reset, the failed one too
    assert summary["failed_episodes"] == 1 and summary["failures"][0]["reason"] == reason
    assert summary["failures"][0]["episode"] == 0
    ep1 = json.loads((tmp_path / "episodes" / "scene1_ep001.json").read_text())
    assert ep1["failure"] is None and ep1["num_steps"] == len(ep1["steps"]) == 10


def test_sessions_horizon_and_scenes_with_a_scripted_link(tmp_path):
    # shorter chunks than the open-loop horizon: query when the chunk runs out
    policy, link = scripted_policy(horizon=5)
    config = EvalConfig(
        out_dir=tmp_path, scenes=(1, 3), episodes_per_scene=2, open_loop_horizon=8, max_steps=12, record_video=False
    )
    summary = run_evaluation(_env, policy, config)
    assert summary["episodes"] == 4 and summary["server_calls"] == 4 * 3  # steps 0, 5, 10
    sessions = [sid for _, _, sid in link.calls]
    per_episode = [sessions[i] for i in range(0, 12, 3)]
    assert len(set(per_episode)) == 4 and link.resets == per_episode  # fresh id per episode, reset after it
    assert {instr for _, instr, _ in link.calls} == {"put the cube in the bowl", "put the banana in the bin"}
    assert [n for n, _, _ in link.calls[:3]] == [1, 4, 4]  # 1 frame starts a session, then 4-frame stacks
    assert set(summary["per_scene"]) == {1, 3}


def test_config_validation(tmp_path):
    with pytest.raises(ConfigError, match="open_loop_horizon"):
        run_evaluation(_env, scripted_policy()[0], EvalConfig(out_dir=tmp_path, open_loop_horizon=0))
    with pytest.raises(ConfigError, match="episodes_per_scene"):
        run_evaluation(_env, scripted_policy()[0], EvalConfig(out_dir=tmp_path, episodes_per_scene=0))
