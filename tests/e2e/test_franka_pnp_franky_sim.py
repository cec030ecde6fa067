"""franka_pnp end to end: `serve run` with `embodiment: franka_pnp` (embedded tiny model, random weights, the shipped
franka_pnp statistics: 19-number state, 7-number actions) answering the Franka client, which picks the embodiment
from the server (OpenPI handshake / HTTP metadata), on franky-sim's arm and on the kinematic simulation.

The tiny model's actions are meaningless: what is checked is the plumbing (sessions reset per episode, the server's
session reports) and that every command stays inside the task's workspace and the joint limits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.franka_pnp import TARGET, task_poses
from tests.support.serve_process import ServeRun

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

#: franky-sim's clock runs slower than the wall clock on a loaded machine (it sleeps to a 1 ms tick but never catches
#: up), so its gripper motions can take several times their real duration
SIM_GRIPPER_TIMEOUT_S = "30"


@pytest.fixture(scope="module")
def pnp_server(tmp_path_factory):
    args = {"embodiment": "franka_pnp", "model_path": None}  # the random tiny model (synthetic franka_pnp stats)
    with ServeRun(tmp_path_factory.mktemp("pnp-serve"), args=args) as server:
        yield server


def _steps(episode_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (episode_dir / "steps.jsonl").read_text().splitlines()]


def _pose_flags() -> list[str]:
    """The task poses, and a chunk check that lets random-weight chunks through, so that the per-step limits are
    what keeps the arm in the box: their values often reach 2-3 (the synthetic statistics un-normalise unclipped
    noise; the default +-1.5 rejects that, rows are clipped to [-1, 1] as RLinf clips them) and they push steadily
    one way (12 rows of 3 cm leave the box by more than the default 0.10 m jump limit)."""
    poses = task_poses()
    return ["--target-ee-pose", *map(str, TARGET), "--home-joints", *map(str, poses.home_joints),
            "--max-abs-action", "100", "--max-jump-m", "10"]  # fmt: skip


def _check_episodes(log_dir: Path, episodes: int) -> list[str]:
    poses = task_poses()
    from dreamzero_franka.pnp.safety import PnpSafetyConfig

    cfg = PnpSafetyConfig()
    summaries = json.loads((log_dir / "session_summary.json").read_text())
    assert [s["status"] for s in summaries] == ["completed"] * episodes, [s["reason"] for s in summaries]
    for index, summary in enumerate(summaries):
        steps = _steps(log_dir / f"episode_{index:04d}")
        reports = [s["server"] for s in steps if s["queried"]]
        # the server's view of the session: fresh at each episode (the client reset it), then continued
        assert [r["step"] for r in reports] == list(range(1, len(reports) + 1))
        assert reports[0]["restarted"] and reports[0]["restart_reason"] in ("new_session", "reset_requested")
        sid = summary["session_id"]  # OpenPI reports it prefixed with the connection's id, HTTP as sent
        assert all(r["session_id"] == sid or r["session_id"].endswith(":" + sid) for r in reports)
        sent = [s for s in steps if "command_pose" in s]
        assert sent, "no command reached the arm"
        for s in sent:
            xyz = np.array(s["command_pose"]).reshape(4, 4)[:3, 3]
            assert np.all(xyz >= poses.workspace_min - 1e-6) and np.all(xyz <= poses.workspace_max + 1e-6), xyz
            joints = np.array(s["command_joints"])
            assert np.all(joints >= cfg.lower - 1e-9) and np.all(joints <= cfg.upper + 1e-9)
        # the measured TCP stayed in the box too (up to the controller's tracking lag)
        measured = np.array([np.array(s["tcp"]).reshape(4, 4)[:3, 3] for s in steps if "tcp" in s])
        assert np.all(measured >= poses.workspace_min - 0.02) and np.all(measured <= poses.workspace_max + 0.02)
    ids = [s["session_id"] for s in summaries]
    assert len(set(ids)) == episodes
    return ids


def test_franka_pnp_episodes_on_franky_sim_over_openpi(franky_sim, pnp_server, tmp_path):
    from dreamzero_franka.cli import main

    ws_url = pnp_server.url.replace("http://", "ws://") + "/v1/realtime/robot/openpi"
    code = main(
        ["--server", ws_url, "--prompt", "put the red block in the bin", "--robot", "franky", "--robot-ip",
         franky_sim, "--no-realtime", "--cameras", "synthetic", "--episodes", "2", "--max-steps", "24",
         "--unattended", "--no-video", "--log-dir", str(tmp_path), "--timeout-s", "120",
         "--gripper-timeout-s", SIM_GRIPPER_TIMEOUT_S, *_pose_flags()]
    )  # fmt: skip
    assert code == 0, pnp_server.log_tail()
    _check_episodes(tmp_path, 2)


def test_franka_pnp_over_http_chosen_by_the_metadata(pnp_server, tmp_path):
    from dreamzero_franka.cli import main

    code = main(
        ["--server", pnp_server.url, "--prompt", "put the red block in the bin", "--robot", "sim", "--cameras",
         "synthetic", "--episodes", "2", "--max-steps", "24", "--unattended", "--no-video", "--log-dir",
         str(tmp_path), "--timeout-s", "120", *_pose_flags()]
    )  # fmt: skip
    assert code == 0, pnp_server.log_tail()
    _check_episodes(tmp_path, 2)
