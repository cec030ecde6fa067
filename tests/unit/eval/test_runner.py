"""The evaluation runner on the MuJoCo scene: outputs, open-loop execution, sessions, and failures mid-run.

The OpenPI runs go over a real WebSocket to the fake server in tests/support/evaluation.py (the live `serve run` of the
tiny model is exercised in tests/e2e when the serve graph is available).
"""

import json

import imageio_ffmpeg
import numpy as np
import pytest

from dreamzero.errors import ConfigError
from dreamzero_droid.links import OpenPILink
from dreamzero_droid.policy import DroidPolicy
from eval.cli import parse_args
from eval.report import write_report
from eval.runner import EvalConfig, run_evaluation
from tests.support.evaluation import FakeOpenPIServer, RtcScriptedLink, mujoco_env, scripted_policy


def test_short_run_over_openpi_websocket_writes_video_json_summary_report(tmp_path):
    with FakeOpenPIServer() as server:
        link = DroidPolicy(OpenPILink(f"ws://127.0.0.1:{server.port}", timeout_s=10))
        try:
            summary = run_evaluation(
                mujoco_env, link, EvalConfig(out_dir=tmp_path, max_steps=20, extra={"simulator": "mujoco"})
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
            summary = run_evaluation(mujoco_env, link, config)
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
                mujoco_env, link, EvalConfig(out_dir=tmp_path, episodes_per_scene=2, max_steps=10, record_video=False)
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
    summary = run_evaluation(mujoco_env, policy, config)
    assert summary["episodes"] == 4 and summary["server_calls"] == 4 * 3  # steps 0, 5, 10
    sessions = [sid for _, _, sid in link.calls]
    per_episode = [sessions[i] for i in range(0, 12, 3)]
    assert len(set(per_episode)) == 4 and link.resets == per_episode  # fresh id per episode, reset after it
    assert {instr for _, instr, _ in link.calls} == {"put the cube in the bowl", "put the banana in the bin"}
    assert [n for n, _, _ in link.calls[:3]] == [1, 4, 4]  # 1 frame starts a session, then 4-frame stacks
    assert set(summary["per_scene"]) == {1, 3}


def test_config_validation(tmp_path):
    with pytest.raises(ConfigError, match="open_loop_horizon"):
        run_evaluation(mujoco_env, scripted_policy()[0], EvalConfig(out_dir=tmp_path, open_loop_horizon=0))
    with pytest.raises(ConfigError, match="episodes_per_scene"):
        run_evaluation(mujoco_env, scripted_policy()[0], EvalConfig(out_dir=tmp_path, episodes_per_scene=0))


# Real-time chunking (docs/rtc.md "Clients"): the delay is emulated, the switch jump is recorded ---------------------
def test_rtc_emulates_the_delay_switches_at_row_d_and_records_the_jump(tmp_path):
    link = RtcScriptedLink()
    policy = DroidPolicy(link, session_prefix="droid-eval")
    config = EvalConfig(out_dir=tmp_path, max_steps=20, record_video=False, rtc=True, rtc_delay_steps=3)
    summary = run_evaluation(mujoco_env, policy, config)
    record = json.loads((tmp_path / "episodes" / "scene1_ep000.json").read_text())
    steps = record["steps"]
    assert [s["step"] for s in steps if s["queried"]] == [0, 8, 16]  # the cadence of the open-loop horizon
    # chunk 1 rows 0..10 (8..10 while chunk 2 "computes"), then chunk 2 from row d = 3
    assert [s["chunk_row"] for s in steps] == [*range(11), *range(3, 11), 3]
    queries = [q.rtc for q in link.queries]
    assert queries[0] is None and [(q.prefix_len, q.exec_horizon) for q in queries[1:]] == [(3, 8), (3, 8)]
    switches = record["chunk_switches"]
    assert [(sw["step"], sw["row"], sw["prefix_len"], sw["exec_horizon"], sw["rtc"]) for sw in switches] == [
        (11, 3, 3, 8, "client_prefix"),
        (19, 3, 3, 8, "client_prefix"),
    ]
    # old row s + d - 1 = 10, then new row d = 3 continuing it: one step of motion, like any step inside a chunk
    np.testing.assert_allclose([sw["jump"] for sw in switches], 0.01 * np.sqrt(7), rtol=1e-5)
    np.testing.assert_allclose(steps[11]["action"][:7], np.asarray(steps[10]["action"][:7]) + 0.01, atol=1e-6)
    assert record["switch_jump"]["count"] == 2 and record["switch_jump"]["max"] == pytest.approx(0.01 * np.sqrt(7))
    assert record["rtc"]["fallback"] is None and [r["step"] for r in record["rtc"]["requests"]] == [8, 16]
    assert summary["rtc"] == {"delay_steps": 3, "fallback": None, "server_sources": {"client_prefix": 2}}
    assert summary["switch_jump"]["count"] == 2


def test_without_rtc_the_switch_jump_is_recorded_too(tmp_path):
    config = EvalConfig(out_dir=tmp_path, max_steps=17, record_video=False)
    summary = run_evaluation(mujoco_env, DroidPolicy(RtcScriptedLink()), config)
    record = json.loads((tmp_path / "episodes" / "scene1_ep000.json").read_text())
    assert [(sw["step"], sw["row"]) for sw in record["chunk_switches"]] == [(8, 0), (16, 0)]
    assert all(sw["jump"] > 0 for sw in record["chunk_switches"]) and record["rtc"] is None
    assert "rtc" not in summary and summary["switch_jump"]["count"] == 2


def test_rtc_with_the_measured_delay_and_a_server_that_refuses_it(tmp_path, caplog):
    link = RtcScriptedLink(refuse="rtc_prefix_len")
    policy = DroidPolicy(link, session_prefix="droid-eval")
    config = EvalConfig(out_dir=tmp_path, max_steps=12, record_video=False, rtc=True)  # in-process: d = 1
    with caplog.at_level("WARNING"):
        summary = run_evaluation(mujoco_env, policy, config)
    record = json.loads((tmp_path / "episodes" / "scene1_ep000.json").read_text())
    assert record["failure"] is None and record["num_steps"] == 12
    assert [(sw["step"], sw["row"], sw["prefix_len"], sw["rtc"]) for sw in record["chunk_switches"]] == [
        (9, 1, 1, None)
    ]
    assert [q.rtc is None for q in link.queries] == [True, False, True]  # refused once, asked again without RTC
    assert "rtc_prefix_len" in record["rtc"]["fallback"] and summary["rtc"]["fallback"] == record["rtc"]["fallback"]
    assert record["rtc"]["requests"][0]["sent"] is False and "real-time chunking off" in caplog.text


def test_rtc_config_and_cli_flags(tmp_path):
    with pytest.raises(ConfigError, match="rtc_delay_steps"):
        run_evaluation(mujoco_env, scripted_policy()[0], EvalConfig(out_dir=tmp_path, rtc_delay_steps=3))
    with pytest.raises(ConfigError, match="rtc.delay_steps = 13"):  # H = 24: d <= 12
        run_evaluation(
            mujoco_env, scripted_policy()[0], EvalConfig(out_dir=tmp_path, max_steps=9, rtc=True, rtc_delay_steps=13)
        )
    args = parse_args(["--rtc", "--rtc-delay-steps", "4"])
    assert args.rtc and args.rtc_delay_steps == 4 and not parse_args([]).rtc
    with pytest.raises(ConfigError, match="--rtc-delay-steps"):
        parse_args(["--rtc-delay-steps", "4"])
