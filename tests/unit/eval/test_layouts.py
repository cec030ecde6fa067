"""`dreamzero-eval --layouts`: the MuJoCo env draws scene 1's cube / bowl placement from the demonstrations' layout
distribution with the episode seed (the recorder's draw), so held-out seeds give held-out layouts of the same kind."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mujoco")

from dreamzero.errors import ConfigError
from eval.cli import make_env_factory, parse_args
from eval.mujoco_droid.env import MujocoDroidEnv
from eval.mujoco_droid.expert import sample_layout


def _xy(env) -> tuple[np.ndarray, np.ndarray]:
    poses = env.object_poses()
    return poses[env.scene.object_name][:2], poses[env.scene.target_name][:2]


def test_reset_places_the_objects_where_the_recorder_would():
    env = MujocoDroidEnv(1, image_size=(32, 48), render_quality="fast", layouts="compact")
    try:
        for seed in (100000, 100001):
            env.reset(seed=seed)
            layout = sample_layout(np.random.default_rng(seed), "compact")
            cube, bowl = _xy(env)
            np.testing.assert_allclose(cube, layout.object_xy, atol=1e-6)
            np.testing.assert_allclose(bowl, layout.target_xy, atol=1e-6)
        env.reset(seed=100000)
        first = _xy(env)
        env.reset(seed=100000)  # the same seed, the same layout: evaluations repeat
        np.testing.assert_array_equal(first[0], _xy(env)[0])
    finally:
        env.close()


def test_without_layouts_the_scene_keeps_its_fixed_positions():
    env = MujocoDroidEnv(1, image_size=(32, 48), render_quality="fast", object_jitter_m=0.0)
    try:
        env.reset(seed=5)
        np.testing.assert_allclose(_xy(env)[0], env.scene.object_xy, atol=1e-6)
    finally:
        env.close()


def test_bad_layouts_settings_name_the_field():
    with pytest.raises(ConfigError, match="layouts: expected one of"):
        MujocoDroidEnv(1, image_size=(32, 48), render_quality="fast", layouts="nowhere")
    with pytest.raises(ConfigError, match="layouts: .*scene 1"):
        MujocoDroidEnv(2, image_size=(32, 48), render_quality="fast", layouts="compact")
    with pytest.raises(ConfigError, match="--layouts"):
        parse_args(["--layouts", "compact", "--scenes", "1", "2"])


def test_the_cli_passes_layouts_to_the_env(tmp_path):
    args = parse_args(["--scenes", "1", "--layouts", "compact", "--image-size", "32", "48", "--out", str(tmp_path)])
    env = make_env_factory(args)(1)
    try:
        assert env.layouts == "compact"
    finally:
        env.close()
