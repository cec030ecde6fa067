"""The teacher-forced reach check (`python -m eval.mujoco_droid.reach_check`): exact for a policy that replays the
expert, a measurable error for one that does not, and clear errors for a bad episode range."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("mujoco")
pytest.importorskip("franky_sim")
pytest.importorskip("imageio_ffmpeg")

from dreamzero.lerobot_dataset import LeRobotDataset
from dreamzero.policy import ReplayPolicy
from eval.mujoco_droid.reach_check import main, reach_check
from eval.mujoco_droid.record import record_demos


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("reach") / "demos"
    record_demos(root, 3, seed=11, image_size=(64, 112), render_quality="fast", layouts="compact")
    return root


def test_a_policy_replaying_the_expert_scores_zero(demos):
    rows = reach_check(lambda ep: ReplayPolicy(demos, ep), demos, range(3))
    assert [r["chunk"] for r in rows] == [1, 2] and all(r["group"] == "all" for r in rows)
    for row in rows:
        assert row["episodes"] == 3 and row["error_cm"] == 0.0 and row["offset_cm_xy"] == [0.0, 0.0]
        assert row["corr_xy"] == [1.0, 1.0] and row["slope_xy"] == [1.0, 1.0]
        assert row["constant_error_cm"] > 0.5  # the three layouts differ, so a constant answer does not


class _Hold:
    """Answers every query with the current joints: the tool stays where it is. Keeps the instructions it was given."""

    def __init__(self):
        self.instructions = []

    def infer(self, observation, session_id, instructions=None, reset=False, seed=None):
        self.instructions.append(instructions)
        q = np.append(observation["state.joint_position"], 0.0)
        return type("R", (), {"actions": np.tile(q, (24, 1))})()


def test_a_policy_that_does_not_move_is_off_by_the_expert_reach(demos):
    hold = _Hold()
    rows = reach_check(lambda ep: hold, demos, range(3))
    assert rows[0]["error_cm"] > 5.0 and rows[0]["corr_xy"] == [None, None]  # the same home pose in every layout
    tasks = LeRobotDataset(demos).tasks()
    assert len(hold.instructions) == 6 and set(hold.instructions) <= set(tasks.values())  # each episode's own task


def test_the_cli_runs_a_model_and_names_a_bad_range(demos, capsys):
    assert main(["--model-path", "embedded:small-scene1", "--dataset", str(demos), "--episodes", "0:2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["chunk"] for r in rows] == [1, 2] and all(r["error_cm"] >= 0 for r in rows)
    for bad in ("0:9", "2", "a:b"):  # one line naming the field, exit status 2, no traceback
        assert main(["--model-path", "embedded:small-scene1", "--dataset", str(demos), "--episodes", bad]) == 2
        assert capsys.readouterr().err.startswith("error: episodes: ")


def test_the_cli_screens_inference_knobs(demos, capsys):
    args = ["--model-path", "embedded:small-scene1", "--dataset", str(demos), "--episodes", "0:2"]
    runs = {}
    for pipeline in ("{}", '{"sigma_shift": 1.0}'):
        assert main([*args, "--pipeline", pipeline]) == 0
        runs[pipeline] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert runs["{}"] != runs['{"sigma_shift": 1.0}']  # the knob reaches the inference loop
    with pytest.raises(SystemExit):
        main(["--expert-through", "x.json", "--dataset", str(demos), "--pipeline", "{}"])
    assert main([*args, "--pipeline", '{"sigma_shift": 0.0}']) == 2  # a bad value, named by the model's own config
    assert re.search("pipeline.*sigma_shift", capsys.readouterr().err)


def test_the_expert_through_percentile_bounds_falls_short_and_through_min_max_does_not(demos, tmp_path, capsys):
    from dreamzero.lerobot_dataset import LeRobotDataset, get_preset
    from dreamzero.metadata import save_metadata
    from dreamzero.metadata_cli import compute_metadata

    errors = {}
    for bounds in ("q01_q99", "min_max"):
        path = tmp_path / f"{bounds}.json"
        save_metadata(compute_metadata(LeRobotDataset(demos), get_preset("oxe_droid"), progress=False,
                                       action_bounds=bounds), path)  # fmt: skip
        assert main(["--expert-through", str(path), "--dataset", str(demos)]) == 0
        errors[bounds] = [json.loads(line)["error_cm"] for line in capsys.readouterr().out.splitlines()]
    assert errors["min_max"] == [0.0, 0.0]
    assert errors["q01_q99"][0] > 0.1  # the clamp cuts the end of the first reach
    with pytest.raises(SystemExit):  # a model and the expert at once
        main(["--expert-through", "x.json", "--model-path", "embedded:small-scene1", "--dataset", str(demos)])


def test_on_scene_4_it_counts_endpoints_nearer_the_named_object(demos, tmp_path):
    """Scene 4 (two objects): each chunk says how often its endpoint is nearer the object the words name; a policy
    replaying the expert scores the expert's count. Scene-1 recordings (one object) carry no such count."""
    scene4 = tmp_path / "scene4"
    record_demos(scene4, 2, seed=5, image_size=(64, 112), render_quality="fast", scene=4, instruction="all")
    rows = reach_check(lambda ep: ReplayPolicy(scene4, ep), scene4, range(2))
    json.dumps(rows)  # the CLI prints each row as JSON
    for row in rows:
        named = row["named_object_closer"]
        assert named["episodes"] == 2 and named["policy"] == named["expert"], row
    assert rows[1]["named_object_closer"]["expert"] == 2  # by chunk 2 the expert is at the object it was told
    assert all("named_object_closer" not in r for r in reach_check(lambda ep: ReplayPolicy(demos, ep), demos, [0]))
