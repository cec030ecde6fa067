"""A NaN or infinite action never reaches a robot (issue 45, item 8): an input the model would turn into NaN (a
finite normalised state of 1e30) is refused naming the field, and non-finite actions are refused, never sent, by the
Policy (every form, the normalised one included) and by postprocess (robot units)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.config.sections import ReplayArgs
from deployments.config.settings import PolicySettings
from deployments.policy import PolicyDeployment
from dreamzero.embodiments import get_embodiment
from dreamzero.embodiments.base import MAX_NORMALISED_STATE
from dreamzero.errors import InvalidObservation
from dreamzero.types import ModelBatch
from tests.support.lerobot import DROID_MODALITY, random_episodes, write_v2
from tests.support.rldx import droid_rldx_observation


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    episodes = random_episodes(1, {"observation.state": 8, "action": 8}, seed=5, lengths=[30])
    root = write_v2(tmp_path_factory.mktemp("ds") / "ds", episodes, modality=DROID_MODALITY)
    return PolicyDeployment(PolicySettings(replay=ReplayArgs(dataset=str(root), episode=0, stride=8)))


def _normalised(sid: str, value: float = 0.1) -> ModelBatch:
    state = np.full((1, 1, 64), value, np.float32)
    return ModelBatch(
        images=np.zeros((1, 1, 32, 32, 3), np.uint8),
        state=state,
        state_mask=np.ones((1, 1, 64), bool),
        prompts=["p"],
        session_ids=[sid],
    )


def test_a_normalised_state_beyond_the_bound_is_refused_naming_the_field(policy):
    with pytest.raises(InvalidObservation) as info:
        asyncio.run(policy.generate(_normalised("big", 1e30)))
    assert info.value.field == "input.observation.state" and "beyond" in str(info.value)
    assert "big" not in policy.pipeline.store  # refused before the store was touched
    out = asyncio.run(policy.generate(_normalised("fine", MAX_NORMALISED_STATE / 2)))
    assert np.isfinite(out.result.actions).all()


def test_non_finite_actions_are_refused_never_sent(policy, monkeypatch):
    nan = np.full_like(policy.pipeline._normalised, np.nan)
    monkeypatch.setattr(policy.pipeline, "_normalised", nan)  # the model's answer turns NaN
    with pytest.raises(InvalidObservation, match="NaN or infinite and were not sent") as info:
        asyncio.run(policy.generate(_normalised("n0")))
    assert info.value.field == "actions"


def test_postprocess_refuses_non_finite_robot_actions():
    emb = get_embodiment("oxe_droid")
    batch, context = emb.preprocess(droid_rldx_observation_raw(emb), ["pick up the cup"], batched=True)
    actions = np.zeros((1, emb.action_horizon, emb.max_action_dim), np.float32)
    assert np.isfinite(emb.postprocess(actions, context)).all()
    actions[0, 3, 0] = np.inf
    with pytest.raises(InvalidObservation, match=r"row\(s\) \[0\].*not sent") as info:
        emb.postprocess(actions, context)
    assert info.value.field == "actions"


def droid_rldx_observation_raw(emb) -> dict:
    """A batch of one DROID observation in the embodiment's own keys (an RLDX-1 observation less its prompt)."""
    obs = droid_rldx_observation()
    return {k: v for k, v in obs.items() if k.startswith(("video.", "state."))}
