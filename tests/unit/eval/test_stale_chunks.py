"""The DROID evaluation's chunk executor on the sim clock: a reply that says the server restarted the session is
never executed (the step asks again from its own observation), RTC's delayed chunk starts d rows in, and every
executed action's observation age is counted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dreamzero.errors import ConfigError
from dreamzero_droid.policy import DroidPolicy, LinkReply
from eval.runner import EvalConfig, run_evaluation
from tests.support.evaluation import RtcScriptedLink, mujoco_env

RESTARTED = {"restarted": True, "restart_reason": "evicted", "step": 0, "incarnation": "b"}


class RestartingLink(RtcScriptedLink):
    """RtcScriptedLink whose calls in `restart_at` (1-based) report a restarted session; every chunk's gripper
    column is its call number / 100, so the steps say which reply was executed."""

    def __init__(self, restart_at: set[int], **kwargs):
        super().__init__(**kwargs)
        self.restart_at = restart_at

    def send(self, query):
        reply = super().send(query)
        n = len(self.calls)
        actions = np.array(reply.actions)
        actions[:, 7] = n / 100
        session = {**(reply.session or {}), **(RESTARTED if n in self.restart_at else {})}
        return LinkReply(actions, session)


def episode(tmp_path) -> dict:
    return json.loads((tmp_path / "episodes" / "scene1_ep000.json").read_text())


def test_restarted_reply_is_never_executed_and_the_step_asks_again(tmp_path):
    link = RestartingLink({2})
    config = EvalConfig(out_dir=tmp_path, max_steps=20, record_video=False)
    summary = run_evaluation(mujoco_env, DroidPolicy(link), config)
    record = episode(tmp_path)
    assert record["stale_chunks"] == [{"step": 8, "reason": "invalidated"}]
    assert record["server_calls"] == 4 and summary["failed_episodes"] == 0  # steps 0, 8 (twice), 16
    executed_calls = {round(s["raw_gripper"] * 100) for s in record["steps"]}
    assert executed_calls == {1, 3, 4}
    assert [s["chunk_row"] for s in record["steps"]] == [*range(8), *range(8), *range(4)]
    assert record["session_restarts"][0] == {"step": 8, "reason": "evicted"}
    execution = record["execution"]
    assert execution["dropped_invalidated"] == 1 and execution["executed"] == 20 and execution["stalls"] == 0
    assert execution["observation_age_s"]["max"] == pytest.approx(7 / 15)  # the sim waits for every query


def test_rtc_chunk_starts_d_rows_in_and_a_restarted_one_is_replaced(tmp_path):
    link = RestartingLink({3})
    config = EvalConfig(out_dir=tmp_path, max_steps=24, record_video=False, rtc=True, rtc_delay_steps=3)
    run_evaluation(mujoco_env, DroidPolicy(link, session_prefix="droid-eval"), config)
    record = episode(tmp_path)
    rows = [s["chunk_row"] for s in record["steps"]]
    # chunk 2 (asked at 8) switches in at row d = 3; chunk 3 (asked at 16) is refused at its switch, step 19 asks
    # afresh and starts at row 0
    assert rows == [*range(11), *range(3, 11), *range(5)]
    assert record["stale_chunks"] == [{"step": 19, "reason": "invalidated"}]
    assert 3 not in {round(s["raw_gripper"] * 100) for s in record["steps"]}
    assert record["execution"]["skipped_actions"] == 3 and record["execution"]["dropped_invalidated"] == 1


def test_two_stale_chunks_in_a_row_fail_the_episode(tmp_path):
    link = RestartingLink(set(range(2, 10)))
    config = EvalConfig(out_dir=tmp_path, max_steps=20, record_video=False)
    summary = run_evaluation(mujoco_env, DroidPolicy(link), config)
    record = episode(tmp_path)
    assert record["failure"]["reason"] == "stale_chunk" and record["failure"]["step"] == 8
    assert summary["failed_episodes"] == 1 and len(record["stale_chunks"]) == 2
    assert {round(s["raw_gripper"] * 100) for s in record["steps"]} == {1}


def test_observation_age_bound_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="max_observation_age_s"):
        run_evaluation(
            mujoco_env, DroidPolicy(RestartingLink(set())), EvalConfig(out_dir=tmp_path, max_observation_age_s=0)
        )
    # a bound shorter than the executed part: the chunk expires on the sim clock and the episode fails, never late
    config = EvalConfig(out_dir=tmp_path, max_steps=20, record_video=False, max_observation_age_s=0.3)
    run_evaluation(mujoco_env, DroidPolicy(RestartingLink(set())), config)
    record = episode(tmp_path)
    assert record["failure"]["reason"] == "stale_chunk" and record["num_steps"] == 5  # ages 0 .. 4/15 s
    assert record["execution"]["observation_age_s"]["max"] <= 0.3


def test_libero_lockstep_chunks_start_at_row_zero_and_their_ages_are_recorded(tmp_path):
    from eval.libero.env import CONTROL_HZ
    from eval.libero.runner import run_libero_evaluation
    from tests.support.libero import FakeBackend, FakeClient, libero_config

    run_libero_evaluation(FakeBackend(num_init_states=1), FakeClient(), libero_config(tmp_path, num_envs=2))
    record = json.loads((tmp_path / "episodes" / "task01_init000.json").read_text())
    execution = record["execution"]
    assert execution["executed"] == record["num_steps"] == 12 and execution["stalls"] == 0
    assert execution["skipped_actions"] == 0 and execution["duplicates"] == 0
    assert execution["observation_age_s"]["max"] == pytest.approx(3 / CONTROL_HZ)  # row 3 of each 4-row chunk
