"""The Franka loop never executes a stale action: a reply delayed past its horizon, a connection lost and retried
(the pending query's reply arriving late) and a reply that says the server restarted the session each make the arm
hold and ask again from a fresh observation; every executed action's observation is within the bound."""

from __future__ import annotations

import json
import time

from dreamzero_droid.links import OpenPILink
from dreamzero_droid.policy import LinkReply
from tests.support.franka import HZ, chunk_near, make_runner


class FaultyLink:
    """A Link whose call i follows `script[i]`: `delay_s` before answering, `raise` an exception instead, `session`
    the reply's session report. Records the OpenPI message of every query and which calls finished."""

    name = "faulty"

    def __init__(self, script: dict[int, dict] | None = None):
        self.script = script or {}
        self.calls: list[dict] = []
        self.finished: list[int] = []

    def send(self, query):
        index = len(self.calls)
        msg = OpenPILink().message(query)
        self.calls.append(msg)
        plan = self.script.get(index, {})
        time.sleep(plan.get("delay_s", 0.0))
        if "raise" in plan:
            raise plan["raise"]
        self.finished.append(index)
        return LinkReply(chunk_near(msg["observation/joint_position"], index), plan.get("session"))

    def reset(self, session_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def steps_of(tmp_path) -> list[dict]:
    lines = (tmp_path / "episode_0000" / "steps.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def executed(steps: list[dict]) -> list[dict]:
    return [s for s in steps if "obs_age_s" in s]


def assert_nothing_stale_executed(result, steps, bound: float, refused_seqs: set[int]) -> None:
    done = executed(steps)
    assert done and len(done) == result.execution["executed"]
    assert max(s["obs_age_s"] for s in done) <= bound
    assert result.execution["observation_age_s"]["max"] <= bound
    assert not {s["chunk_seq"] for s in done} & refused_seqs


def test_reply_delayed_past_its_horizon_is_dropped_and_the_arm_asks_again(tmp_path):
    # call 0 at tick 0; call 1 is the prefetch of tick 6 (lead 2), 1.5 s late against a 1 s bound
    link = FaultyLink({1: {"delay_s": 1.5}})
    runner, robot, _ = make_runner(
        link, max_steps=30, prefetch=True, prefetch_lead_steps=2, max_observation_age_s=1.0, chunk_wait_s=3.0,
        log_dir=str(tmp_path),
    )  # fmt: skip
    result = runner.run_episode(0)
    assert result.status == "completed"
    steps = steps_of(tmp_path)
    assert result.stale_chunks == 1 and result.execution["dropped_stale"] == 1
    stale = next(s for s in steps if s.get("stale"))
    assert stale["step"] == 8 and stale["stale"] == "too_old" and stale["held"]
    # the next tick asks again (blocking) and executes the fresh chunk from row 0
    fresh = steps[9]
    assert fresh["queried"] and fresh["chunk_seq"] == 3 and fresh["start_row"] == 0 and fresh["chunk_row"] == 0
    assert_nothing_stale_executed(result, steps, 1.0, refused_seqs={2})
    # on-time prefetches still start `lead` rows in: those rows are counted as skipped
    prefetched = [s for s in steps if s.get("start_row") == 2]
    assert prefetched and result.execution["skipped_actions"] == 2 * len(prefetched)
    assert robot.holding


def test_lost_connection_and_late_reply_of_the_pending_query_are_never_executed(tmp_path):
    # call 1 (prefetch) answers after 2 s, past the loop's 0.6 s wait: timeout; call 2 finds the server gone;
    # call 3 reaches it again. Call 1's late reply must never be executed.
    link = FaultyLink({1: {"delay_s": 2.0}, 2: {"raise": ConnectionError("connection refused")}})
    runner, _, _ = make_runner(
        link, max_steps=60, prefetch=True, prefetch_lead_steps=2, chunk_wait_s=0.6, query_retries=2,
        max_observation_age_s=1.5, log_dir=str(tmp_path),
    )  # fmt: skip
    result = runner.run_episode(0)
    assert result.status == "completed", result.reason
    deadline = time.monotonic() + 5.0
    while 1 not in link.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 1 in link.finished  # the reply did arrive, late
    steps = steps_of(tmp_path)
    failed = [s for s in steps if s.get("query_failed")]
    # (a later prefetch may time out too: it waits behind call 1 on the one background thread)
    assert [f["step"] for f in failed][:2] == [8, 9] and result.retried_queries >= 2
    assert failed[0]["query_failed"].startswith("timeout") and "server_unreachable" in failed[1]["query_failed"]
    assert steps[10]["queried"] and steps[10]["chunk_seq"] == 4 and steps[10]["chunk_row"] == 0  # fresh observation
    assert_nothing_stale_executed(result, steps, 1.5, refused_seqs={2, 3})


def test_retries_exhausted_fail_the_episode_with_the_reason():
    link = FaultyLink({i: {"raise": ConnectionError("connection refused")} for i in range(1, 10)})
    runner, robot, _ = make_runner(link, max_steps=40, query_retries=2)
    result = runner.run_episode(0)
    assert result.status == "failed" and result.reason.startswith("server_unreachable")
    assert result.retried_queries == 2 and len(link.calls) == 4 and robot.holding


def test_reply_flagged_restarted_is_not_executed_and_the_next_query_is_fresh(tmp_path):
    restarted = {"session_id": "x", "step": 0, "incarnation": "b", "restarted": True, "restart_reason": "evicted"}
    link = FaultyLink({2: {"session": restarted}})
    runner, _, _ = make_runner(link, max_steps=30, log_dir=str(tmp_path))
    result = runner.run_episode(0)
    assert result.status == "completed"
    steps = steps_of(tmp_path)
    assert steps[16]["session_restarted"] == "evicted" and steps[16]["stale"] == "invalidated"
    assert steps[17]["queried"] and steps[17]["chunk_seq"] == 4 and steps[17]["chunk_row"] == 0
    assert result.stale_chunks == 1 and result.execution["dropped_invalidated"] == 1
    assert_nothing_stale_executed(result, steps, runner.config.max_observation_age_s, refused_seqs={3})


def test_expired_chunk_mid_execution_holds_and_asks_again(tmp_path):
    # a 0.35 s bound: a reply 0.25 s late ages past it before its 8 rows at 50 Hz (0.16 s) are executed
    link = FaultyLink({0: {"delay_s": 0.25}})
    runner, _, _ = make_runner(link, max_steps=12, max_observation_age_s=0.35, log_dir=str(tmp_path))
    result = runner.run_episode(0)
    steps = steps_of(tmp_path)
    expired = [s for s in steps if s.get("stale") == "observation_expired"]
    assert expired and result.execution["stalls"] == len(expired)
    first = [s for s in executed(steps) if s["chunk_seq"] == 1]
    assert 0 < len(first) < 8 and first[0]["chunk_row"] == 0  # the first chunk's rest was never executed
    assert_nothing_stale_executed(result, steps, 0.35, refused_seqs=set())


def test_queries_carry_the_fleet_fields():
    link = FaultyLink()
    runner, _, _ = make_runner(link, max_steps=10, prefetch=True, prefetch_lead_steps=2)
    before = time.time()
    runner.run_episode(0)
    blocking, prefetch = link.calls[0], link.calls[1]
    assert blocking["traffic_class"] == ["realtime"] and "deadline_ms" not in blocking
    assert before <= blocking["observed_at"][0] <= time.time()
    assert prefetch["deadline_ms"] == [2 * 1e3 / HZ]  # the lead's two ticks
    quiet = FaultyLink()
    runner, _, _ = make_runner(quiet, max_steps=10, fleet_fields=False)
    runner.run_episode(0)
    assert not {"traffic_class", "deadline_ms", "observed_at"} & set(quiet.calls[0])


def test_cli_flags_set_the_bound_and_the_retries():
    from dreamzero_franka.cli import _loop_config, build_parser

    base = ["--server", "ws://127.0.0.1:9", "--prompt", "p"]
    default = _loop_config(build_parser().parse_args(base), "oxe_droid")
    assert default.max_observation_age_s == 5.0 and default.query_retries == 0
    ns = build_parser().parse_args([*base, "--max-observation-age-s", "0", "--query-retries", "2"])
    config = _loop_config(ns, "oxe_droid")
    assert config.max_observation_age_s is None and config.query_retries == 2
