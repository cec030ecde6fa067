"""The Isaac Lab sim-evals adapter against the real simulator (needs Isaac Sim on an NVIDIA RTX GPU; skipped
elsewhere with that reason). The same contract check runs on every machine against a fake with the simulator's
observation structure in tests/unit/eval/test_isaac_adapter.py."""

from __future__ import annotations

import pytest

from eval.env_contract import check_droid_env

pytestmark = pytest.mark.isaac


@pytest.mark.parametrize("scene", [1, 2, 3])
def test_each_scene_meets_the_droid_env_contract(scene):
    from eval.isaac_sim_evals import make_isaac_env

    env = make_isaac_env(scene, headless=True, max_episode_steps=5)
    try:
        check_droid_env(env, steps=2, seed=0)  # reset, observation keys/dtypes/shapes, steps, is_success() a bool
    finally:
        env.close()
