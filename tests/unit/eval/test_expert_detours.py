"""Expert detours (`dreamzero-record-demos --detours P`): via points drawn from the widened object patches, an expert
that passes through them and still puts the cube in the bowl, and the recorder keeping them in `meta/layouts.json`."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("mujoco")
pytest.importorskip("franky_sim")
pytest.importorskip("imageio_ffmpeg")

from dreamzero.errors import ConfigError
from eval.mujoco_droid.expert import (
    _CARRY_Z,
    _HOVER_Z,
    DETOUR_MARGIN_M,
    LAYOUTS,
    Detours,
    ScriptedExpert,
    reset_with_layout,
    sample_detours,
    sample_layout,
)
from eval.mujoco_droid.record import record_demos


def _inside(xy, box, margin):
    (x0, y0), (x1, y1) = box
    return x0 - margin <= xy[0] <= x1 + margin and y0 - margin <= xy[1] <= y1 + margin


def test_detours_are_drawn_with_their_probability_from_the_widened_patches():
    spec, rng = LAYOUTS["compact"], np.random.default_rng(0)
    never = [sample_detours(rng, "compact", 0.0) for _ in range(50)]
    assert all(d.reach is None and d.carry is None for d in never)
    always = [sample_detours(rng, "compact", 1.0) for _ in range(200)]
    assert all(_inside(d.reach, spec.object_box, DETOUR_MARGIN_M) for d in always)
    assert all(_inside(d.carry, spec.target_box, DETOUR_MARGIN_M) for d in always)
    # spread beyond the patch itself: the arm is sometimes where no object can be
    assert any(not _inside(d.reach, spec.object_box, 0.0) for d in always)
    some = [sample_detours(rng, "compact", 0.5) for _ in range(400)]
    assert 0.4 < np.mean([d.reach is not None for d in some]) < 0.6
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="detours: expected a probability"):
            sample_detours(rng, "compact", bad)


def test_expert_passes_through_its_via_points_and_still_succeeds():
    from eval.mujoco_droid.env import MujocoDroidEnv

    env = MujocoDroidEnv(1, image_size=(32, 48), render_quality="fast", max_episode_steps=400)
    try:
        layout = sample_layout(np.random.default_rng(3), "compact")
        via = Detours(reach=(0.42, -0.02), carry=(0.58, 0.0))  # far from both patches' centres
        reset_with_layout(env, 3, layout)
        expert = ScriptedExpert(env)
        expert.reset(via)
        path, info = [], {}
        while not expert.done:
            _, _, _, _, info = env.step(expert.act())
            path.append(env.tcp_position())
        for _ in range(6):  # let the cube settle in the bowl
            _, _, _, _, info = env.step(expert.act())
    finally:
        env.close()
    path = np.array(path)
    for xy, z in ((via.reach, _HOVER_Z), (via.carry, _CARRY_Z)):
        assert np.linalg.norm(path - np.array([*xy, z]), axis=1).min() < 0.02
    assert info["success"]


def test_recorder_keeps_each_episodes_detours(tmp_path):
    root = tmp_path / "demos"
    summary = record_demos(root, 1, seed=7, image_size=(32, 48), render_quality="fast", layouts="compact", detours=1)
    assert summary["episodes"] == 1
    (record,) = json.loads((root / "meta" / "layouts.json").read_text())
    assert record["detour_reach_xy"] is not None and record["detour_carry_xy"] is not None
    with pytest.raises(ConfigError, match="detours"):
        record_demos(tmp_path / "bad", 1, layouts="compact", detours=2.0)
