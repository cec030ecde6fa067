"""`dreamzero-franka --record-dataset`: both control modes on the simulated arm against a fake OpenPI server write a
LeRobot v3.0 dataset that `dreamzero-make-metadata` and `dreamzero-train` read as it is; labels, aborts, faults and
a client stopped mid-episode are kept and marked; a robot install without the `record` extra still runs and hears
which extra the option needs."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from dreamzero_franka.cli import main
from dreamzero_franka.common.operator import Command
from dreamzero_franka.pnp.actions import PnpActionSpace, action_to_target, base_frame_action, executed_action
from dreamzero_franka.pnp.rotations import rlinf_adjoint
from tests.support.franka import FakeOpenPIServer, ScriptedOperator, ScriptedTransport
from tests.support.franka_pnp import TARGET, joints_for, task_poses

SIM = ["--robot", "sim", "--cameras", "synthetic", "--unattended", "--no-video", "--control-hz", "30"]
DROID_VIEWS = ("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left")


def _pnp_flags() -> list[str]:
    return ["--target-ee-pose", *map(str, TARGET), "--home-joints", *map(str, task_poses().home_joints)]


def _steps(episode_dir) -> list[dict]:
    return [json.loads(line) for line in (episode_dir / "steps.jsonl").read_text().splitlines()]


def _metadata_and_one_train_step(ds, preset: str, tmp_path, capsys) -> dict:
    """`dreamzero-make-metadata generate DS --preset <preset>`, then one `dreamzero-train` step on DS with it."""
    import torch

    from dreamzero.metadata_cli import main as make_metadata
    from dreamzero.train.cli import main as train

    meta = tmp_path / f"{preset}-metadata.json"
    assert make_metadata(["generate", str(ds), "--preset", preset, "-o", str(meta), "--no-progress"]) == 0
    metadata = json.loads(meta.read_text())
    capsys.readouterr()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = ["--dataset", str(ds), "--embodiment", preset, "--metadata", str(meta), "--out",
                str(tmp_path / f"{preset}-run"), "--steps", "1", "--batch-size", "1", "--blocks", "1"]  # fmt: skip
        assert train(argv) == 0
    finally:
        torch.set_num_threads(before)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
    return metadata[preset]


@pytest.mark.slow
def test_droid_episodes_recorded_then_metadata_and_train(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("imageio_ffmpeg")
    from dreamzero_droid.lerobot import episode_marks

    ds, logs = tmp_path / "droid", tmp_path / "logs"
    with FakeOpenPIServer() as server:
        argv = ["--server", server.url, "--prompt", "stack the cups", *SIM, "--episodes", "2", "--max-steps", "12",
                "--log-dir", str(logs), "--record-dataset", str(ds)]  # fmt: skip
        assert main(argv) == 0
    marks = episode_marks(ds)
    # unattended: no verdict asked, so success is unknown and the episode ran to its end
    assert [(m["length"], m["success"], m["outcome"]) for m in marks] == [(12, None, "done")] * 2
    info = json.loads((ds / "meta" / "info.json").read_text())
    assert info["fps"] == 30 and info["robot_type"] == "franka (oxe_droid)"
    for view in DROID_VIEWS:
        assert info["features"][f"observation.images.{view}"]["shape"] == [180, 320, 3]  # as the policy keeps them
    assert info["features"]["observation.state"]["shape"] == [8] == info["features"]["action"]["shape"]

    from dreamzero.lerobot_dataset import LeRobotDataset

    cols = LeRobotDataset(ds).episode_columns(1, ["observation.state", "action"])
    steps = _steps(logs / "episode_0001")
    # the action is what the safety filter sent, the state what the policy saw, tick by tick
    np.testing.assert_allclose(cols["action"][:, :7], [s["command"] for s in steps], atol=1e-6)
    np.testing.assert_allclose(cols["action"][:, 7], [float(s["gripper_command"]) for s in steps])
    np.testing.assert_allclose(cols["observation.state"][:, :7], [s["joint_position"] for s in steps], atol=1e-6)

    stats = _metadata_and_one_train_step(ds, "oxe_droid", tmp_path, capsys)
    assert set(stats["modalities"]["video"]) == set(DROID_VIEWS)


@pytest.mark.slow
def test_franka_pnp_episodes_recorded_then_metadata_and_train(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("imageio_ffmpeg")
    from dreamzero.lerobot_dataset import LeRobotDataset

    ds, logs = tmp_path / "pnp", tmp_path / "logs"
    with FakeOpenPIServer(embodiment="franka_pnp") as server:
        argv = ["--server", server.url, "--prompt", "put the block in the bin", "--robot", "sim", "--cameras",
                "synthetic", "--unattended", "--no-video", "--episodes", "2", "--max-steps", "16", "--log-dir",
                str(logs), "--record-dataset", str(ds), *_pnp_flags()]  # fmt: skip
        assert main(argv) == 0
    info = json.loads((ds / "meta" / "info.json").read_text())
    assert info["fps"] == 10 and info["total_episodes"] == 2 and info["total_frames"] == 32
    for view in ("image", "wrist_image"):
        assert info["features"][f"observation.images.{view}"]["shape"] == [128, 128, 3]  # the views sent
    assert info["features"]["state"]["shape"] == [19] and info["features"]["actions"]["shape"] == [7]

    cols = LeRobotDataset(ds).episode_columns(0, ["state", "actions"])
    steps = _steps(logs / "episode_0000")
    np.testing.assert_allclose(cols["state"], [s["state"] for s in steps], atol=1e-6)
    # the row recorded is the command the safety filter let through, read back against the pose measured then
    space = PnpActionSpace()
    for i, s in enumerate(steps):
        pose = np.reshape(s["command_pose"], (4, 4)) if "command_pose" in s else None
        expected = executed_action(pose, np.reshape(s["tcp"], (4, 4)), s["gripper_command"], space)
        np.testing.assert_allclose(cols["actions"][i], expected, atol=1e-4)
    # and it is the server's row where the filter only kept the tilt inside its 0.01 rad window: the motion in x / y
    # as sent (the tilt clamp moves the rest by a hair)
    kept = [i for i, s in enumerate(steps) if "command_pose" in s and set(s["clamped"]) <= {"rotation_window"}]
    assert len(kept) > len(steps) // 2, [s["clamped"] for s in steps]
    sent = np.clip([steps[i]["action"] for i in kept], -1, 1)
    np.testing.assert_allclose(cols["actions"][kept, :2], sent[:, :2], atol=0.05)
    np.testing.assert_allclose(cols["actions"][:, 6], [-1.0 if s["gripper_command"] else 1.0 for s in steps])

    stats = _metadata_and_one_train_step(ds, "franka_pnp", tmp_path, capsys)
    assert len(stats["statistics"]["state"]["state"]["mean"]) == 19


def test_executed_action_gives_back_the_row_the_filter_let_through():
    space = PnpActionSpace()
    from dreamzero_franka.pnp.arm_model import tcp_pose

    tcp = tcp_pose(joints_for(TARGET + np.array([0, 0, 0.1, 0, 0, 0])))
    rng = np.random.default_rng(0)
    for scale in (0.3, 0.9):
        for _ in range(20):
            row = np.append(rng.uniform(-scale, scale, 6), rng.choice([-1.0, 1.0]))
            target = action_to_target(row, tcp, space)
            got = executed_action(target.pose, tcp, target.gripper_closed, space)
            if scale < 0.5:  # small rows: nothing was clipped on the way, the row itself comes back
                np.testing.assert_allclose(got, row, atol=1e-5)
            # in general: the row as RLinf executes it (clipped in the base frame), back in the TCP frame
            executed = np.linalg.solve(rlinf_adjoint(tcp), base_frame_action(row, tcp, space)[:6])
            np.testing.assert_allclose(got[:6], np.clip(executed, -1, 1), atol=1e-5)
    held = executed_action(None, tcp, True, space)
    assert held.tolist() == [0, 0, 0, 0, 0, 0, -1]


def test_labels_aborts_and_faults_are_kept_and_marked(tmp_path):
    pytest.importorskip("pyarrow")
    pytest.importorskip("imageio_ffmpeg")
    from dreamzero_droid.droid import CAMERAS
    from dreamzero_droid.lerobot import episode_marks
    from dreamzero_droid.policy import DroidPolicy
    from dreamzero_franka.common.loop import LoopConfig
    from dreamzero_franka.common.sim_backends import SimGripper, SimRobot, SyntheticCamera
    from dreamzero_franka.droid.loop import DroidEpisodeRunner
    from dreamzero_franka.recording import open_dataset

    # ep 0: labelled success at its 4th tick; ep 1: runs out, labelled failure; ep 2: aborted by the operator at its
    # 5th tick (and its label skipped); ep 3: the server is lost at its second query (a chunk every 2 ticks)
    operator = ScriptedOperator(
        at_poll={3: [Command.SUCCESS], 14: [Command.ABORT]},
        waits=[Command.START, Command.START, Command.FAILURE, Command.START, Command.NEXT],
    )
    link = ScriptedTransport(fail_from=8)
    devices = SimRobot(), SimGripper(), {name: SyntheticCamera(name) for name in CAMERAS}
    for device in (*devices[:2], *devices[2].values()):
        device.connect()
    dataset = open_dataset(tmp_path / "ds", "oxe_droid", 30.0)
    config = LoopConfig(control_hz=30.0, max_steps=6, open_loop_horizon=2)
    runner = DroidEpisodeRunner(*devices, DroidPolicy(link, "stack the cups"), config=config, operator=operator,
                           dataset=dataset)  # fmt: skip
    results = runner.run(4)
    dataset.close()
    assert [(r.status, r.label) for r in results] == [
        ("completed", "success"), ("completed", "failure"), ("aborted", None), ("failed", None)
    ]  # fmt: skip
    marks = episode_marks(tmp_path / "ds")
    assert [(m["length"], m["success"], m["outcome"]) for m in marks] == [
        (3, True, "success"), (6, False, "failure"), (4, None, "aborted"), (2, None, "failed")
    ]  # fmt: skip
    assert marks[2]["note"] == "aborted by the operator" and marks[3]["note"].startswith("server_unreachable")


@pytest.mark.parametrize(
    "exc, outcome, note",
    [(KeyboardInterrupt(), "aborted", "interrupted (Ctrl+C)"),
     (RuntimeError("camera driver crashed"), "failed", "unexpected error: RuntimeError: camera driver crashed")],
)  # fmt: skip
def test_a_client_stopped_mid_episode_leaves_a_valid_dataset(exc, outcome, note, tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    pytest.importorskip("imageio_ffmpeg")
    from dreamzero.lerobot_dataset import LeRobotDataset
    from dreamzero_droid.lerobot import episode_marks
    from dreamzero_franka.common import sim_backends

    original, calls = sim_backends.SyntheticCamera.observe, []

    def observe(camera):  # three cameras a tick: the 43rd frame is episode 1's 5th tick
        calls.append(camera.name)
        if len(calls) == 43:
            raise exc
        return original(camera)

    monkeypatch.setattr(sim_backends.SyntheticCamera, "observe", observe)
    with FakeOpenPIServer() as server:
        argv = ["--server", server.url, "--prompt", "stack the cups", *SIM, "--episodes", "3", "--max-steps", "10",
                "--log-dir", "", "--record-dataset", str(tmp_path / "ds")]  # fmt: skip
        if isinstance(exc, KeyboardInterrupt):  # the episode ends aborted, the session stops, nothing failed
            assert main(argv) == 0
        else:  # a bug: the arm holds, the episode is marked, the exception goes on up
            with pytest.raises(RuntimeError, match="camera driver crashed"):
                main(argv)
    marks = episode_marks(tmp_path / "ds")
    assert [(m["length"], m["outcome"]) for m in marks] == [(10, "done"), (4, outcome)]
    assert marks[1]["note"] == note
    assert LeRobotDataset(tmp_path / "ds").episode_indices == [0, 1]


def test_without_the_record_extra_the_robot_runs_and_the_option_names_the_extra(tmp_path, monkeypatch, capsys):
    for module in ("pyarrow", "pyarrow.parquet", "imageio_ffmpeg"):
        monkeypatch.setitem(sys.modules, module, None)  # `import pyarrow` now raises ImportError
    with FakeOpenPIServer() as server:
        base = ["--server", server.url, "--prompt", "stack the cups", *SIM, "--max-steps", "4"]
        assert main([*base, "--log-dir", str(tmp_path / "logs")]) == 0
        assert not server.killed.is_set()
        before = len(server.events)
        assert main([*base, "--log-dir", "", "--record-dataset", str(tmp_path / "ds")]) == 2
        assert len(server.events) == before  # refused before anything connected
    err = capsys.readouterr().err
    assert "pip install 'dreamzero-droid[record]'" in err
    assert not (tmp_path / "ds").exists()


def test_the_cli_imports_no_recording_code_unless_asked():
    import subprocess

    code = (
        "import sys; import dreamzero_franka.cli; "
        "bad = [m for m in ('pyarrow', 'imageio_ffmpeg', 'dreamzero_droid.lerobot') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
