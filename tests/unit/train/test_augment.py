"""State noise with relabelled targets: the noisy state plus the new deltas reach the expert's absolute joints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dreamzero.embodiments import get_embodiment
from dreamzero.errors import ConfigError
from dreamzero.train.augment import perturb_states, state_noise_plan
from tests.support.embodiments import droid_metadata, libero_metadata


def _normalised(emb, joints, gripper, targets):
    """Model-width (state [1, K, 1, 64], actions [1, K, A, 32]) as make_clip writes them."""
    k, a = targets.shape[:2]
    raw = {"state.joint_position": joints, "state.gripper_position": gripper}
    norm = np.concatenate([emb.state_normalisers[key].normalise(raw[key]) for key in emb.state_keys], -1)
    state = np.zeros((1, k, 1, emb.max_state_dim))
    state[0, :, 0, : norm.shape[1]] = norm
    gain, bias = emb.action_codec(raw)
    padded = np.zeros((k, a, emb.max_action_dim))
    padded[..., : targets.shape[2]] = targets
    actions = np.where(gain[:, None] > 0, (padded - bias[:, None]) / np.where(gain > 0, gain, 1.0)[:, None], 0.0)
    return torch.tensor(state, dtype=torch.float32), torch.tensor(actions[None], dtype=torch.float32), gain


def test_noisy_state_plus_relabelled_deltas_reach_the_same_absolute_joints():
    emb = get_embodiment("oxe_droid", droid_metadata())  # joint state spans [-2, 2] (joint 7 constant), deltas [-1, 1]
    rng = np.random.default_rng(0)
    joints = rng.uniform(-0.5, 0.5, (2, 7))
    joints[:, 6] = 0.5
    gripper = np.array([[0.2], [0.7]])
    targets = np.concatenate([joints[:, None] + rng.uniform(-0.3, 0.3, (2, 5, 7)), np.full((2, 5, 1), 1.0)], -1)
    state, actions, gain = _normalised(emb, joints, gripper, targets)
    plan = state_noise_plan(emb)
    assert plan.state_cols.tolist() == list(range(6)) and plan.action_cols.tolist() == list(range(6))  # joint 7 fixed
    gen = torch.Generator().manual_seed(3)
    new_state, new_actions = perturb_states(state, actions, plan, 0.1, gen)
    noise = (new_state - state)[0, :, 0, :6].double().numpy() * 2.0  # state span 4 -> raw = normalised * 2
    assert noise.std() == pytest.approx(0.1, rel=0.5)  # raw units
    # un-normalise the new targets with the noisy state: the same absolute joints as the expert's
    noisy = {"state.joint_position": joints + np.pad(noise, ((0, 0), (0, 1))), "state.gripper_position": gripper}
    new_gain, new_bias = emb.action_codec(noisy)
    robot = new_gain[:, None] * new_actions[0].double().numpy() + new_bias[:, None]
    np.testing.assert_allclose(robot[..., :7], targets[..., :7], atol=1e-5)
    # the gripper, the constant joint and the padding are untouched
    assert torch.equal(new_actions[..., 6:], actions[..., 6:]) and torch.equal(new_state[..., 6:], state[..., 6:])
    assert torch.equal(state, _normalised(emb, joints, gripper, targets)[0])  # inputs are not modified in place


def test_targets_stay_in_range_and_an_absolute_embodiment_is_refused():
    emb = get_embodiment("oxe_droid", droid_metadata())
    state = torch.zeros(3, 2, 1, 64)
    actions = torch.full((3, 2, 24, 32), 0.99)
    plan = state_noise_plan(emb)
    new_state, new_actions = perturb_states(state, actions, plan, 5.0, torch.Generator().manual_seed(0))
    assert new_actions.abs().max() <= 1.0 and new_state.abs().max() <= 1.0
    with pytest.raises(ConfigError, match="state_noise: libero_sim has no relative actions"):
        state_noise_plan(get_embodiment("libero_sim", libero_metadata()))
