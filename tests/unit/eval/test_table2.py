"""Scene 4, the two-object table: layouts, the instruction per episode, the verdict (success, wrong object, wrong
target), the expert on the hardest pair, the recorder, the per-instruction summary and the CLI."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("mujoco")
pytest.importorskip("franky_sim")

from dreamzero.errors import ConfigError
from eval.env_contract import check_droid_env
from eval.mujoco_droid import table2
from eval.mujoco_droid.env import MujocoDroidEnv
from eval.mujoco_droid.scene import HOME_QPOS
from eval.success import LIFTED_M, placement_outcome
from eval.summary import summarize, summary_markdown


@pytest.fixture(scope="module")
def env():
    e = MujocoDroidEnv(4, image_size=(32, 48), render_quality="fast", max_episode_steps=400)
    yield e
    e.close()


def _put(env, name, xy, z=0.0):
    adr = env._free_qpos[name]
    env.data.qpos[adr : adr + 3] = [xy[0], xy[1], z]
    env.data.qpos[adr + 3 : adr + 7] = [1.0, 0.0, 0.0, 0.0]
    env.data.qvel[:] = 0.0


# -- layouts and instructions ----------------------------------------------------------------------------------------
def test_layouts_stay_on_the_patch_apart_and_vary():
    rng = np.random.default_rng(0)
    layouts = [table2.sample_layout(rng) for _ in range(300)]
    pts = {name: np.array([lay[name] for lay in layouts]) for name in (*table2.OBJECTS, *table2.TARGETS)}
    for xy in pts.values():
        assert (xy[:, 0] >= table2.LAYOUT_X[0]).all() and (xy[:, 0] <= table2.LAYOUT_X[1]).all()
        assert (xy[:, 1] >= table2.LAYOUT_Y[0]).all() and (xy[:, 1] <= table2.LAYOUT_Y[1]).all()
        assert xy[:, 1].std() > 0.1  # each body lands left and right: no side of the table tells which one it is
    dist = lambda a, b: np.linalg.norm(pts[a] - pts[b], axis=1)  # noqa: E731
    assert (dist("bowl", "mug") >= table2.MIN_TARGET_TARGET_M).all()
    assert (dist("cube", "can") >= table2.MIN_OBJECT_OBJECT_M).all()
    for o in table2.OBJECTS:
        for t in table2.TARGETS:
            assert (dist(o, t) >= table2.MIN_OBJECT_TARGET_M).all()


def test_each_instruction_names_one_object_and_one_target_and_all_four_are_balanced():
    assert len(set(table2.INSTRUCTIONS)) == 4
    assert Counter(t.object_name for t in table2.TASKS) == {"cube": 2, "can": 2}
    assert Counter(t.target_name for t in table2.TASKS) == {"bowl": 2, "mug": 2}
    for start in (0, 4000, 123):  # any run of consecutive seeds: every instruction once per aligned block of four
        counts = Counter(table2.episode_instruction(s).instruction for s in range(start, start + 40))
        assert set(counts) == set(table2.INSTRUCTIONS) and max(counts.values()) - min(counts.values()) <= 2
    orders = {tuple(table2.episode_instruction(s).instruction for s in range(4 * k, 4 * k + 4)) for k in range(20)}
    assert len(orders) > 5  # shuffled per block, not a fixed rotation
    assert table2.episode_instruction(7, "put the can in the mug").object_name == "can"
    with pytest.raises(ConfigError, match="instruction"):
        table2.episode_instruction(0, "put the banana in the bin")


# -- the env -----------------------------------------------------------------------------------------------------------
def test_env_contract_and_reset_draws_layout_and_instruction_from_the_seed(env):
    check_droid_env(env)
    env.reset(seed=4001)
    assert env.instruction == table2.episode_instruction(4001).instruction
    assert (env.task_object, env.task_target) == (
        table2.task_for(env.instruction).object_name,
        table2.task_for(env.instruction).target_name,
    )
    layout = table2.sample_layout(np.random.default_rng(4001))
    poses = env.object_poses()
    assert set(poses) == {"cube", "can", "bowl", "mug"}
    for name, xy in layout.items():
        np.testing.assert_allclose(poses[name][:2], xy, atol=1e-6)
    assert not env.is_success() and env.outcome() == {
        "instruction": env.instruction, "object": env.task_object, "target": env.task_target,
        "success": False, "wrong_target": False, "wrong_object": False,
    }  # fmt: skip
    fixed = MujocoDroidEnv(4, image_size=(16, 16), render_quality="fast", instruction="put the can in the bowl")
    try:
        fixed.reset(seed=4001)  # the same layout whatever the instruction: only the words differ
        assert fixed.instruction == "put the can in the bowl"
        for name, xy in layout.items():
            np.testing.assert_allclose(fixed.object_poses()[name][:2], xy, atol=1e-6)
    finally:
        fixed.close()


def test_instruction_is_refused_where_it_does_not_apply():
    with pytest.raises(ConfigError, match="instruction"):
        MujocoDroidEnv(4, image_size=(16, 16), instruction="put the bowl in the cube")
    with pytest.raises(ConfigError, match="instruction"):
        MujocoDroidEnv(1, image_size=(16, 16), instruction="put the can in the mug")


def test_verdict_success_wrong_target_and_wrong_object(env):
    env.reset(seed=0)
    task = table2.task_for(env.instruction)
    poses = env.object_poses()
    named_target, other_target = poses[task.target_name][:2], poses[task.other_target][:2]
    _put(env, task.object_name, named_target, 0.01)
    env.step(np.append(HOME_QPOS, 0.0))
    out = env.outcome()
    assert env.is_success() and out["success"] and not out["wrong_target"] and not out["wrong_object"]

    env.reset(seed=0)
    _put(env, task.object_name, other_target, 0.01)
    env.step(np.append(HOME_QPOS, 0.0))
    out = env.outcome()
    assert not out["success"] and out["wrong_target"] and not out["wrong_object"]

    env.reset(seed=0)  # the other object picked up and put back down where it was: still the wrong object
    start = env.object_poses()[task.other_object][:2]
    _put(env, task.other_object, start, 0.15)
    env.step(np.append(HOME_QPOS, 0.0))
    _put(env, task.other_object, start, 0.0)
    env.step(np.append(HOME_QPOS, 0.0))
    out = env.outcome()
    assert out["wrong_object"] and not out["success"] and not out["wrong_target"]
    env.reset(seed=0)
    assert not env.outcome()["wrong_object"]  # forgotten at reset


def test_the_other_object_knocked_over_is_not_lifted():
    e = MujocoDroidEnv(4, image_size=(16, 16), render_quality="fast", instruction="put the can in the bowl")
    try:
        e.reset(seed=5)
        adr = e._free_qpos["cube"]
        e.data.qpos[adr + 2] = 0.05  # upside down: its base 5 cm up, its centre where it was
        e.data.qpos[adr + 3 : adr + 7] = [0.0, 1.0, 0.0, 0.0]
        for _ in range(3):
            e.step(np.append(HOME_QPOS, 0.0))
        assert e.object_poses()["cube"][2] > LIFTED_M and not e.outcome()["wrong_object"]
    finally:
        e.close()


def test_placement_outcome_counts_the_other_object_in_either_target():
    poses = {"cube": (0.5, 0.3, 0.0), "can": (0.5, 0.0, 0.01), "bowl": (0.5, 0.0, 0.0), "mug": (0.5, -0.3, 0.0)}
    out = placement_outcome(poses, "cube", "mug", "can", "bowl", other_lifted=False)
    assert out == {"success": False, "wrong_target": False, "wrong_object": True}


def test_the_expert_puts_the_can_in_the_mug():
    from eval.mujoco_droid.expert_check import run_expert

    e = MujocoDroidEnv(4, image_size=(16, 16), render_quality="fast", max_episode_steps=400,
                       instruction="put the can in the mug")  # fmt: skip
    try:
        out = run_expert(e, seed=3)
        assert out["success"] and not out["wrong_object"] and not out["wrong_target"], out
        # in it, not on its rim: the can's base rests on the mug's floor
        assert e.object_poses()["can"][2] - e.object_poses()["mug"][2] < 0.02
    finally:
        e.close()


# -- the recorder ------------------------------------------------------------------------------------------------------
def test_recorder_writes_each_episode_with_its_instruction_as_the_task(tmp_path):
    # with detours on every leg, and still kept: the expert corrects from the via points on this scene too
    pytest.importorskip("imageio_ffmpeg")
    from dreamzero.lerobot_dataset import LeRobotDataset
    from eval.mujoco_droid.record import read_episodes, record_demos

    root = tmp_path / "scene4"
    summary = record_demos(root, 2, seed=0, image_size=(32, 48), render_quality="fast", scene=4, detours=1.0)
    asked = [table2.episode_instruction(s).instruction for s in (0, 1)]
    assert summary["scene"] == 4 and summary["attempts"] == 2 and summary["tasks"] == dict(Counter(sorted(asked)))
    assert len(set(asked)) == 2  # seeds 0 and 1 of one block ask different instructions
    episodes = read_episodes(root)
    assert [e.task for e in episodes] == asked
    assert sorted(LeRobotDataset(root).tasks().values()) == sorted(asked)
    layouts = json.loads((root / "meta" / "layouts.json").read_text())
    assert [r["instruction"] for r in layouts] == asked and {"cube_xy", "mug_xy"} <= set(layouts[0])
    assert all(r["detour_reach_xy"] is not None and r["detour_carry_xy"] is not None for r in layouts)
    with pytest.raises(ConfigError, match="layouts"):
        record_demos(tmp_path / "bad", 1, scene=4, layouts="compact")
    with pytest.raises(ConfigError, match="instruction"):
        record_demos(tmp_path / "bad", 1, scene=1, instruction="put the can in the mug")


# -- summary and CLI ---------------------------------------------------------------------------------------------------
def _episode(ep, instruction, success, wrong_object=False, wrong_target=False, failure=None):
    return {
        "scene_id": 4, "episode": ep, "instruction": instruction, "success": success, "failure": failure,
        "latencies_ms": [10.0], "server_calls": 1, "num_steps": 5, "session_id": f"s{ep}",
        "outcome": {"instruction": instruction, "success": success, "wrong_object": wrong_object,
                    "wrong_target": wrong_target},
    }  # fmt: skip


def test_summary_per_instruction_with_wrong_object_and_wrong_target_rates():
    a, b = "put the cube in the bowl", "put the can in the mug"
    eps = [
        _episode(0, a, True),
        _episode(1, a, False, wrong_target=True),
        _episode(2, b, False, wrong_object=True, wrong_target=True),
        _episode(3, b, True),
        _episode(4, b, False, failure={"reason": "server_unreachable", "message": "x", "step": 1}),
    ]
    s = summarize(eps)
    rows = s["per_instruction"]
    assert (rows[a]["successes"], rows[a]["episodes"], rows[a]["wrong_target"]) == (1, 2, 1)
    assert (rows[b]["wrong_object"], rows[b]["failed"], rows[b]["success_rate"]) == (1, 1, pytest.approx(1 / 3))
    assert rows[a]["ci95"][0] == pytest.approx(0.0945, abs=1e-4)  # Wilson 1/2
    assert (s["wrong_object"]["count"], s["wrong_target"]["count"], s["wrong_object_or_target"]["count"]) == (1, 2, 2)
    assert s["wrong_object_or_target"]["rate"] == pytest.approx(0.4)
    assert s["per_scene"][4]["instruction"] == "2 instructions"
    md = summary_markdown(s)
    assert "| put the can in the mug | 1/3 (33%) |" in md and "Wrong object: 20%" in md
    one_object = summarize([{**e, "scene_id": 1, "outcome": None} for e in eps])
    assert "per_instruction" not in one_object and "wrong_object" not in one_object  # scenes 1-3: as before


def test_cli_runs_scene4_and_reports_per_instruction(tmp_path, capsys):
    from eval.cli import main, parse_args
    from tests.support.evaluation import FakeOpenPIServer

    assert main(["--scenes", "1", "--instruction", "put the can in the mug"]) == 2
    assert "--instruction" in capsys.readouterr().err
    assert main(["--scenes", "4", "--instruction", "put the can in the bin"]) == 2
    assert "--instruction: expected one of" in capsys.readouterr().err
    assert main(["--scenes", "4", "--sim", "isaac"]) == 2
    assert "scene 4" in capsys.readouterr().err
    assert parse_args(["--scenes", "4", "--instructions", "all"]).instruction == "all"
    with FakeOpenPIServer() as server:
        code = main(["--scenes", "4", "--episodes", "2", "--max-steps", "3", "--render", "fast",
                     "--image-size", "32", "48", "--port", str(server.port), "--timeout-s", "10",
                     "--out", str(tmp_path), "--no-progress", "--no-video"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    asked = [table2.episode_instruction(4000 + e).instruction for e in range(2)]  # seed + 1000 * scene + episode
    for instruction in asked:
        assert f"| {instruction} | 0/1 (0%) |" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(summary["per_instruction"]) == sorted(asked)
    assert summary["config"]["extra"]["instruction"] == "all"
    assert "Per instruction" in (tmp_path / "report.html").read_text()
    assert (tmp_path / "plots" / "success_per_instruction.png").is_file()
