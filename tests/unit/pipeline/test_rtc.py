"""Real-time chunking maths: the soft mask, option checks, the action codec, and the clamp on a stub smooth prior.

The stub prior is a Gaussian process over the chunk (independent per dim) whose exact flow-matching velocity is
known in closed form, so the project's action scheduler loop runs as in the pipeline without a DiT.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dreamzero import rtc
from dreamzero.embodiments import get_embodiment
from dreamzero.errors import InvalidObservation
from dreamzero.model.scheduler import FlowUniPCScheduler
from dreamzero.sessions import PreviousChunk, SessionState
from dreamzero.types import ModelBatch
from tests.support.embodiments import droid_metadata, droid_observation, stats

# -- 1. the soft mask ------------------------------------------------------------------------------------------------


def test_soft_mask_values_for_known_h_d_s():
    # H = 8, d = 2, s = 3: prefix [0, 2), decay over [2, 5) with c_i = (5 - i) / 4, zero from 5 on
    w = rtc.soft_mask(8, 2, 3)
    expect = [1.0, 1.0, 0.4875510, 0.1887703, 0.0413240, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(w, expect, atol=1e-7)
    # DROID-sized: H = 24, d = 4, s = 8 -> ramp over [4, 16), c_4 = 12 / 13
    w = rtc.soft_mask(24, 4, 8)
    c = 12 / 13
    assert w[:4].tolist() == [1.0] * 4 and w[16:].tolist() == [0.0] * 8
    assert w[4] == pytest.approx(c * (math.exp(c) - 1) / (math.e - 1), abs=1e-12)
    assert np.all(np.diff(w[3:17]) < 0)  # strictly decaying over the ramp
    # s = H - d: the ramp is empty, a hard prefix only
    assert rtc.soft_mask(24, 4, 20).tolist() == [1.0] * 4 + [0.0] * 20
    with pytest.raises(ValueError, match=r"d \(5\) <= s \(4\)"):
        rtc.soft_mask(24, 5, 4)


# -- 2. request options -------------------------------------------------------------------------------------------


def batch_of(n: int = 1, **kw) -> ModelBatch:
    return ModelBatch(
        images=np.zeros((n, 1, 8, 8, 3), np.uint8),
        state=np.zeros((n, 1, 64), np.float32),
        state_mask=np.ones((n, 1, 64), bool),
        prompts=["p"] * n,
        session_ids=[f"s{i}" for i in range(n)],
        **kw,
    )


def test_defaults_follow_rldx():
    prefix = np.zeros((4, 8))
    reqs = rtc.requests(
        batch_of(4, rtc_prefix_len=[None, 4, 2, 3], rtc_exec_horizon=[None, None, None, 6],
                 action_prefix=[None, None, np.zeros((6, 8)), prefix]),
        24, 32,
    )  # fmt: skip
    assert reqs[0] is None  # nothing asked: off
    assert (reqs[1].d, reqs[1].s, reqs[1].prefix) == (4, 20, None)  # cache: s = H - d
    assert (reqs[2].d, reqs[2].s) == (2, 18)  # a 6-action prefix: s = H - P
    assert (reqs[3].d, reqs[3].s) == (3, 6)
    only_prefix = rtc.requests(batch_of(1, action_prefix=[prefix]), 24, 32)[0]
    assert (only_prefix.d, only_prefix.s) == (4, 20)  # RLDX: the prefix is the d actions
    assert rtc.requests(batch_of(1, rtc_prefix_len=[0], action_prefix=[prefix]), 24, 32) == [None]


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"rtc_prefix_len": [13]}, "rtc_prefix_len"),  # d <= H / 2
        ({"rtc_prefix_len": [-1]}, "rtc_prefix_len"),
        ({"rtc_prefix_len": [True]}, "rtc_prefix_len"),
        ({"rtc_prefix_len": [2, 2]}, "rtc_prefix_len"),  # one entry per row
        ({"rtc_prefix_len": [4], "rtc_exec_horizon": [3]}, "rtc_exec_horizon"),  # s >= d
        ({"rtc_prefix_len": [4], "rtc_exec_horizon": [21]}, "rtc_exec_horizon"),  # s <= H - d
        ({"rtc_prefix_len": [4], "action_prefix": [np.zeros((3, 8))]}, "action_prefix"),  # P >= d
        ({"rtc_prefix_len": [2], "action_prefix": [np.zeros((23, 8))]}, "action_prefix"),  # s = H - P < d
        ({"action_prefix": [np.zeros((13, 8))]}, "action_prefix"),  # d = P = 13 > H / 2
        ({"action_prefix": [np.zeros((4,))]}, "action_prefix"),
        ({"action_prefix": [np.full((4, 8), np.nan)]}, "action_prefix"),
        ({"action_prefix": [np.zeros((4, 33))]}, "action_prefix"),
        ({"action_gain": np.ones((1, 32))}, "action_bias"),
        ({"action_gain": np.ones((1, 8)), "action_bias": np.ones((1, 8))}, "action_gain"),
    ],
)
def test_bad_options_name_the_field(kw, field):
    with pytest.raises(InvalidObservation) as err:
        rtc.requests(batch_of(1, **kw), 24, 32)
    assert err.value.field == field


# -- 3. the action codec (embodiments) --------------------------------------------------------------------------------


def varied_droid_metadata() -> dict:
    meta = droid_metadata()
    # joint deltas with uneven ranges, one constant dim (q01 == q99); gripper in [0, 1]
    meta["oxe_droid"]["statistics"]["action"]["joint_position"] = stats(
        [-0.5, -1, -2, -0.1, 0, -3, 0.2], [0.5, 3, 2, 0.3, 1, -1, 0.2]
    )
    return meta


def test_codec_is_postprocess_before_the_gripper_rule():
    emb = get_embodiment("oxe_droid", varied_droid_metadata())
    batch, ctx = emb.preprocess(droid_observation(batch=2), "pick")
    model = np.random.default_rng(0).uniform(-1.2, 1.2, (2, 24, 32))
    robot = rtc.to_robot(model, batch.action_gain[:, None], batch.action_bias[:, None])
    out = emb.postprocess(model, ctx)
    np.testing.assert_allclose(robot[..., :6], out[..., :6], atol=1e-5)  # un-normalised deltas + current joints
    np.testing.assert_array_equal(np.where(robot[..., 7] > 0.5, 1.0, 0.0), out[..., 7])
    assert np.isnan(robot[..., 8:]).all()  # padding has no robot meaning
    assert np.isnan(robot[..., 6]).all()  # nor has a constant dim (postprocess returns its constant)


def test_relative_rebasing_under_a_new_state():
    """An absolute action kept from the previous call, re-encoded for the joints the robot has NOW."""
    meta = varied_droid_metadata()
    emb = get_embodiment("oxe_droid", meta)
    old_obs, new_obs = droid_observation(), droid_observation()
    new_obs["state.joint_position"] = old_obs["state.joint_position"] + np.array([0.1, -0.2, 0.05, 0, 0.3, -0.1, 0])
    old, _ = emb.preprocess(old_obs, "pick")
    new, _ = emb.preprocess(new_obs, "pick")
    model_prev = np.random.default_rng(1).uniform(-1, 1, (24, 32))
    absolute = rtc.to_robot(model_prev, old.action_gain[0], old.action_bias[0])
    y = rtc.to_model(absolute, new.action_gain[0], new.action_bias[0])
    st = meta["oxe_droid"]["statistics"]["action"]
    q01, q99 = np.array(st["joint_position"]["q01"]), np.array(st["joint_position"]["q99"])
    delta = absolute[:, :6] - new_obs["state.joint_position"][:6]  # the delta from the new joints
    np.testing.assert_allclose(y[:, :6], 2 * (delta - q01[:6]) / (q99[:6] - q01[:6]) - 1, atol=1e-9)
    np.testing.assert_allclose(y[:, 7], model_prev[:, 7], atol=1e-12)  # absolute gripper: unchanged
    assert np.isnan(y[:, 6]).all() and np.isnan(y[:, 8:]).all()
    # the same absolute target, so the robot sees one continuous trajectory whatever the state moved
    np.testing.assert_allclose(rtc.to_robot(y, new.action_gain[0], new.action_bias[0])[:, :6], absolute[:, :6])


def test_codec_of_an_absolute_embodiment_ignores_the_state():
    emb = get_embodiment("libero_sim")
    views = np.zeros((2, 256, 256, 3), np.uint8)
    state = np.random.default_rng(0).normal(size=(2, 8))
    obs = {"video.image": views, "video.wrist_image": views, "state.state": state}
    batch, _ = emb.preprocess(obs, "pick")
    np.testing.assert_array_equal(batch.action_gain[0], batch.action_gain[1])
    np.testing.assert_array_equal(batch.action_bias[0], batch.action_bias[1])
    assert (batch.action_gain[:, 7:] == 0).all()


# -- 4. the clamp on a stub smooth prior -------------------------------------------------------------------------------

H, D_REAL, D = 24, 2, 4  # two real dims, two padding dims


def gp_kernel(length: float = 4.0) -> torch.Tensor:
    t = torch.arange(H, dtype=torch.float64)
    return torch.exp(-((t[:, None] - t[None]) ** 2) / (2 * length**2)) + 1e-6 * torch.eye(H)


def prior_velocity(a: torch.Tensor, sigma: float, k: torch.Tensor) -> torch.Tensor:
    """Exact flow velocity of x0 ~ N(0, K) per dim: E[x0 | a] = (1-sigma) K M^-1 a, M = (1-sigma)^2 K + sigma^2 I;
    v = (a - E[x0 | a]) / sigma."""
    m = (1 - sigma) ** 2 * k + sigma**2 * torch.eye(H, dtype=k.dtype)
    x0 = (1 - sigma) * k @ torch.linalg.solve(m, a.double())
    return ((a.double() - x0) / sigma).float()


def sample(seed: int, k: torch.Tensor, guide: rtc.ActionGuide | None = None) -> torch.Tensor:
    sched = FlowUniPCScheduler(16, 5.0)
    a = torch.randn(1, H, D, generator=torch.Generator().manual_seed(seed))
    for i in range(16):
        sigma = float(sched.sigmas[i])
        v = prior_velocity(a, sigma, k)
        a = sched.step(v if guide is None else guide.velocity(a, v, sigma), i, a)
    return a if guide is None else guide.finish(a)


def guide_from_cache(prev: np.ndarray, d: int, s: int, gain=None, bias=None) -> tuple[rtc.ActionGuide, list]:
    state = SessionState("s0", "p", "n", prev_chunk=PreviousChunk(prev, "normalised" if gain is None else "robot"))
    batch = batch_of(1, rtc_prefix_len=[d], rtc_exec_horizon=[s], action_gain=gain, action_bias=bias)
    return rtc.plan(batch, [state], H, (H, D), torch.device("cpu"))


def test_clamp_keeps_the_prefix_and_smooths_the_switch():
    k = gp_kernel()
    d, s = 4, 8
    gain = np.zeros((1, D))
    gain[:, :D_REAL] = 1.0  # padding dims: gain 0, never steered
    bias = np.zeros((1, D))
    jumps = {"none": [], "rtc": [], "natural": []}
    for seed in range(16):
        prev = sample(1000 + seed, k)[0].double().numpy()
        prev_robot = rtc.to_robot(prev, gain[0], bias[0])
        guide, sources = guide_from_cache(prev_robot, d, s, gain, bias)
        assert sources == ["session_cache"]
        new = sample(seed, k, guide)[0].numpy()
        free = sample(seed, k)[0].numpy()
        np.testing.assert_allclose(new[:d, :D_REAL], prev[s : s + d, :D_REAL], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(new[:, D_REAL:], free[:, D_REAL:])  # W = 0 dims: bit for bit
        switch = prev[s + d - 1, :D_REAL]  # the last previous-chunk action the robot runs, then new[d]
        jumps["rtc"].append(np.linalg.norm(new[d, :D_REAL] - switch))
        jumps["none"].append(np.linalg.norm(free[d, :D_REAL] - switch))
        jumps["natural"].append(np.linalg.norm(prev[s + d, :D_REAL] - switch))
    mean = {key: float(np.mean(v)) for key, v in jumps.items()}
    assert mean["rtc"] < 0.5 * mean["none"], mean
    assert mean["rtc"] < 2.0 * mean["natural"], mean


def test_guide_leaves_unasked_rows_bit_for_bit():
    k = gp_kernel()
    prev = sample(7, k)[0].double().numpy()
    state = SessionState("s0", "p", "n", prev_chunk=PreviousChunk(prev, "normalised"))
    other = SessionState("s1", "p", "n", prev_chunk=PreviousChunk(prev, "normalised"))
    batch = batch_of(2, rtc_prefix_len=[4, None])
    guide, sources = rtc.plan(batch, [state, other], H, (H, D), torch.device("cpu"))
    assert sources == ["session_cache", None]
    a = torch.randn(2, H, D, generator=torch.Generator().manual_seed(0))
    v = torch.randn(2, H, D, generator=torch.Generator().manual_seed(1))
    out = guide.velocity(a, v, 0.7)
    assert torch.equal(out[1], v[1]) and not torch.equal(out[0], v[0])
    assert rtc.plan(batch_of(2), [state, other], H, (H, D), torch.device("cpu")) == (None, [None, None])


def test_client_prefix_wins_and_units_must_match():
    prev = np.ones((H, D))
    prefix = np.full((4, 2), 0.25)
    state = SessionState("s0", "p", "n", prev_chunk=PreviousChunk(prev, "normalised"))
    guide, sources = rtc.plan(batch_of(1, action_prefix=[prefix]), [state], H, (H, D), torch.device("cpu"))
    assert sources == ["client_prefix"]
    assert (guide.target[0, :4, :2] == 0.25).all() and guide.hard[0, :4, :2].all() and not guide.hard[0, :, 2:].any()
    # a chunk kept in normalised units is no target for a call in robot units: cold start
    gain, bias = np.ones((1, D)), np.zeros((1, D))
    cold = rtc.plan(batch_of(1, rtc_prefix_len=[4], action_gain=gain, action_bias=bias), [state], H, (H, D), "cpu")
    assert cold == (None, ["cold_start"])
