"""Real-time chunking through the pipeline (tiny DiT, stand-in encoders) and the embedded policy."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero import rtc
from dreamzero.embodiments import get_embodiment
from dreamzero.errors import InvalidObservation, InvalidRequest
from dreamzero.policy import EmbeddedPolicy
from tests.support.embodiments import droid_metadata, droid_observation
from tests.support.pipeline import ScriptedPipeline, make_batch, make_model, make_pipe, scripted_chunk

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return make_model()


def two_calls(model, second: dict, first: dict | None = None, ids=("a",)):
    """A first chunk, then a continuing one with `second`'s fields: (chunk 1, result 2)."""
    pipe = make_pipe(model)
    c1 = pipe.generate(make_batch(list(ids), seeds=[1] * len(ids), **(first or {}))).actions
    res = pipe.generate(make_batch(list(ids), t=4, seeds=[2] * len(ids), **second))
    return c1, res


def codec(n: int, seed: int) -> dict:
    """An affine map like an embodiment's: 8 real dims, padding with gain 0."""
    rng = np.random.default_rng(seed)
    gain, bias = np.zeros((n, 32)), np.zeros((n, 32))
    gain[:, :8] = rng.uniform(0.2, 2.0, (n, 8))
    bias[:, :8] = rng.normal(size=(n, 8))
    return {"action_gain": gain, "action_bias": bias}


def test_without_rtc_the_chunk_is_bit_identical(model):
    _, plain = two_calls(model, {})
    # d = 0, an execution horizon alone, and an action codec change nothing
    _, off = two_calls(model, {"rtc_prefix_len": [0], "rtc_exec_horizon": [8], **codec(1, 0)}, codec(1, 0))
    np.testing.assert_array_equal(plain.actions, off.actions)
    assert plain.sessions[0].rtc is None and off.sessions[0].rtc is None
    # asked, but nothing to continue (a new session): cold start, reported, same chunk as today
    pipe = make_pipe(model)
    cold = pipe.generate(make_batch(["a"], seeds=[1], rtc_prefix_len=[4]))
    np.testing.assert_array_equal(cold.actions, make_pipe(model).generate(make_batch(["a"], seeds=[1])).actions)
    assert cold.sessions[0].rtc == "cold_start" and "rtc" in cold.sessions[0].to_dict()
    assert "rtc" not in plain.sessions[0].to_dict()  # the wire reply is unchanged when RTC is not asked


def test_cached_chunk_gives_the_prefix_and_pulls_the_overlap(model):
    d, s = 4, 8
    c1, plain = two_calls(model, {})
    _, res = two_calls(model, {"rtc_prefix_len": [d], "rtc_exec_horizon": [s]})
    assert res.sessions[0].rtc == "session_cache"
    np.testing.assert_array_equal(res.actions[0, :d], c1[0, s : s + d])  # new action i = previous action s + i
    ramp = slice(d, 24 - s)  # the soft-mask region: closer to the previous plan than without RTC
    assert np.abs(res.actions[0, ramp] - c1[0, s + d :]).mean() < np.abs(plain.actions[0, ramp] - c1[0, s + d :]).mean()


def test_rows_without_rtc_are_untouched_in_a_mixed_batch(model):
    _, plain = two_calls(model, {}, ids=("a", "b"))
    _, mixed = two_calls(model, {"rtc_prefix_len": [4, None]}, ids=("a", "b"))
    np.testing.assert_array_equal(mixed.actions[1], plain.actions[1])
    assert [r.rtc for r in mixed.sessions] == ["session_cache", None]
    assert not np.array_equal(mixed.actions[0], plain.actions[0])


def test_client_prefix_wins_over_the_cache(model):
    prefix = np.random.default_rng(3).uniform(-1, 1, (4, 32))
    c1, res = two_calls(model, {"action_prefix": [prefix]})
    assert res.sessions[0].rtc == "client_prefix"
    np.testing.assert_array_equal(res.actions[0, :4], prefix.astype(np.float32))
    assert not np.array_equal(res.actions[0, :4], c1[0, 20:24])


def test_relative_rebasing_through_the_pipeline(model):
    """The kept chunk is in robot units; the next call's map (a new state) re-encodes it: robot actions continue."""
    first, second = codec(1, 0), codec(1, 1)
    c1, res = two_calls(model, {"rtc_prefix_len": [4], "rtc_exec_horizon": [8], **second}, first)
    robot_prev = rtc.to_robot(c1[0, 8:12].astype(np.float64), first["action_gain"][0], first["action_bias"][0])
    robot_new = rtc.to_robot(res.actions[0, :4].astype(np.float64), second["action_gain"][0], second["action_bias"][0])
    np.testing.assert_allclose(robot_new[:, :8], robot_prev[:, :8], atol=1e-5)
    # units differ from the kept chunk (normalised form first, robot units now): no target, a cold start
    _, cold = two_calls(model, {"rtc_prefix_len": [4], **second})
    assert cold.sessions[0].rtc == "cold_start"


def test_resets_clear_the_chunk_and_model_restarts_keep_it(model):
    pipe = make_pipe(model)
    pipe.generate(make_batch(["a", "b", "c"], seeds=[1, 1, 1]))
    pipe.reset_sessions(["a"])
    batch = make_batch(["a", "b", "c"], t=4, rtc_prefix_len=[4, 4, 4], reset_mask=[False, True, False])
    assert [r.rtc for r in pipe.generate(batch).sessions] == ["cold_start", "cold_start", "session_cache"]
    # a stale client (step mismatch) starts cold; a 1-frame input restarts the model, not the robot: kept
    batch = make_batch(["a", "c"], t=1, rtc_prefix_len=[4, 4], expected_steps=[7, None])
    res = pipe.generate(batch)
    assert [(r.restart_reason, r.rtc) for r in res.sessions] == [("step_mismatch", "cold_start"),
                                                                  ("single_frame", "session_cache")]  # fmt: skip


def test_bad_options_fail_before_any_session_is_touched(model):
    pipe = make_pipe(model)
    pipe.generate(make_batch(["a"]))
    step = pipe.store.lookup("a")[0].step
    with pytest.raises(InvalidObservation) as err:
        pipe.generate(make_batch(["a"], t=4, rtc_prefix_len=[4], rtc_exec_horizon=[2]))
    assert err.value.field == "rtc_exec_horizon" and pipe.store.lookup("a")[0].step == step


# -- embedded policy ---------------------------------------------------------------------------------------------------


def test_embedded_policy_passes_rtc_options_and_the_codec():
    pipeline = ScriptedPipeline(scripted_chunk())
    policy = EmbeddedPolicy(pipeline, get_embodiment("oxe_droid", droid_metadata()))
    prefix = np.zeros((4, 8))
    policy.infer(droid_observation(), "r0", "pick", rtc_prefix_len=4, action_prefix=prefix, rtc_exec_horizon=8)
    sent = pipeline.batches[-1]
    assert sent.rtc_prefix_len == [4] and sent.rtc_exec_horizon == [8]
    np.testing.assert_array_equal(sent.action_prefix[0], prefix)
    assert sent.action_gain.shape == (1, 32) and sent.action_bias.shape == (1, 32)
    policy.infer(droid_observation(batch=2), ["r0", "r1"], "pick", action_prefix=[None, prefix])
    assert pipeline.batches[-1].action_prefix[0] is None and pipeline.batches[-1].rtc_prefix_len is None
    with pytest.raises(InvalidRequest, match="action_prefix"):
        policy.infer(droid_observation(), "r0", "pick", action_prefix=np.zeros((4, 7)))
    with pytest.raises(InvalidRequest, match="action_prefix"):
        policy.infer(droid_observation(batch=2), ["r0", "r1"], "pick", action_prefix=[prefix])


@pytest.mark.slow  # builds and runs the embedded tiny model
def test_embedded_policy_continues_the_robot_trajectory():
    """Tiny model end to end: with the joints moved between calls, the first d robot actions of the new chunk are
    the previous chunk's actions s .. s+d-1 in absolute joint units (before the gripper rule); d = 0 changes nothing."""
    policy = EmbeddedPolicy.load(None)  # the random tiny model
    kept = []
    generate = policy.pipeline.generate

    def recording(batch):
        out = generate(batch)
        kept.append((batch, out.actions.copy()))
        return out

    policy.pipeline.generate = recording
    policy.infer(droid_observation(), "e2e", "put the cube in the bowl")
    obs = droid_observation(frames=4, seed=1)
    obs["state.joint_position"] = obs["state.joint_position"] + 0.05
    out = policy.infer(obs, "e2e", "put the cube in the bowl", rtc_prefix_len=4, rtc_exec_horizon=8)
    assert out.sessions[0].rtc == "session_cache"
    (b1, a1), (b2, _) = kept
    prev_robot = rtc.to_robot(a1[0].astype(np.float64), b1.action_gain[0], b1.action_bias[0])
    np.testing.assert_allclose(out.actions[:4, :7], prev_robot[8:12, :7], atol=1e-4)
    assert np.abs(b2.action_bias[0, :7] - b1.action_bias[0, :7]).min() > 0.04  # the map followed the new joints
    # d = 0 on the real tiny model: bit for bit the chunks of a session that never asked
    plain = [policy.infer(droid_observation(), "plain", "put the cube in the bowl")]
    zero = [policy.infer(droid_observation(), "zero", "put the cube in the bowl", rtc_prefix_len=0)]
    plain.append(policy.infer(obs, "plain", "put the cube in the bowl"))
    zero.append(policy.infer(obs, "zero", "put the cube in the bowl", rtc_prefix_len=0, rtc_exec_horizon=8))
    for p, z in zip(plain, zero):
        np.testing.assert_array_equal(p.actions, z.actions)
