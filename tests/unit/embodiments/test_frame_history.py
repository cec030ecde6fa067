"""The frames a session's later queries send (`frame_offsets`) and the instruction's key (`language_key`) are declared
once, on the embodiment: the ZeroMQ door advertises the served embodiment's, the evals send them, and the robot-side
copies (the client packages cannot import the server) agree with them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dreamzero.embodiments import get_embodiment, known_tags, register_embodiment
from dreamzero.embodiments.franka_pnp import FrankaPnp
from dreamzero.embodiments.libero_sim import LiberoSim
from dreamzero.embodiments.oxe_droid import OxeDroid
from dreamzero.errors import ConfigError


def test_every_built_in_robot_declares_its_frame_history():
    for tag in ("oxe_droid", "libero_sim", "franka_pnp"):
        emb = get_embodiment(tag)
        assert emb.frame_offsets[-1] == 0 and len(emb.frame_offsets) == 4, tag
        # the oldest frame lies within the chunk just executed
        assert -emb.action_horizon < emb.frame_offsets[0] < 0, tag
        assert emb.language_key.startswith("annotation."), tag
    assert OxeDroid.language_key != LiberoSim.language_key


def test_the_robot_side_copies_agree():
    from dreamzero_droid import droid
    from dreamzero_franka.pnp.policy import frame_offsets
    from eval.imagined import BLOCK_STEPS
    from eval.libero.adapter import FRAME_OFFSETS

    assert droid.FRAME_OFFSETS == OxeDroid.frame_offsets
    assert frame_offsets(FrankaPnp.action_horizon) == FrankaPnp.frame_offsets
    assert FRAME_OFFSETS == LiberoSim.frame_offsets
    assert BLOCK_STEPS == OxeDroid.action_horizon


@pytest.mark.parametrize(
    ("offsets", "language_key", "field"),
    [
        (None, "annotation.x", "frame_offsets"),
        ((-8, -16, 0), "annotation.x", "frame_offsets"),  # not oldest first
        ((-16, -8), "annotation.x", "frame_offsets"),  # does not end at the current frame
        ([-8, 0], "annotation.x", "frame_offsets"),  # a list: class attributes stay immutable
        ((-8, 0), "", "language_key"),
    ],
)
def test_a_robot_without_a_valid_frame_history_is_refused_at_registration(offsets, language_key, field):
    class Arm(LiberoSim):
        tag = f"frame_history_test_{field}"
        frame_offsets = offsets
        language_key = "annotation.x"

    Arm.language_key = language_key
    with pytest.raises(ConfigError, match=rf"Arm\.{field}"):
        register_embodiment(Arm)
    assert Arm.tag not in known_tags()


@pytest.mark.parametrize("tag", ["oxe_droid", "libero_sim"])
def test_the_zmq_door_advertises_the_served_embodiment(tag):
    from deployments.doors.zmq import ZmqDoor

    emb = get_embodiment(tag)

    async def model_info():
        return SimpleNamespace(action_horizon=emb.action_horizon)

    door = object.__new__(ZmqDoor)  # the door's modality answer, without a socket or a graph
    door.embodiment, door.runner = emb, SimpleNamespace(model_info=model_info)
    modality = asyncio.run(door.modality_config())
    assert modality["video"].delta_indices == list(emb.frame_offsets)
    assert modality["language"].modality_keys == [emb.language_key]
    assert len(modality["action"].delta_indices) == emb.action_horizon


def test_training_clips_hold_the_frames_the_embodiment_sends():
    """A LIBERO clip's block shows the steps at LiberoSim.frame_offsets from the block's end, as the eval sends."""
    import numpy as np

    from dreamzero.train.data import EpisodeArrays, make_clip
    from tests.support.embodiments import libero_metadata

    emb = get_embodiment("libero_sim", libero_metadata("libero_sim"))
    n = 3 * emb.action_horizon
    step = np.arange(n, dtype=np.uint8)[:, None, None, None]  # every pixel of frame i is i
    views = {k: np.broadcast_to(step, (n, *emb.view_hw, 3)).copy() for k in emb.video_keys}
    episode = EpisodeArrays(
        state={k: np.zeros((n, emb.state_widths[k])) for k in emb.state_keys},
        action={k: np.zeros((n, emb.action_widths[k])) for k in emb.action_keys},
        views=views,
        task="pick",
    )
    clip = make_clip(episode, t0=0, blocks=1, embodiment=emb)
    shown = [int(np.median(frame)) for frame in clip.block_frames[0]]
    assert shown == [emb.action_horizon + off for off in LiberoSim.frame_offsets]  # 1, 6, 11, 16
