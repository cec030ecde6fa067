"""Real-time chunking in the client runtime: the delay estimate, the timeline (which rows are sent, skipped and
executed), the RTC fields on both links, and the fallback to plain chunks when a server refuses or ignores them."""

from __future__ import annotations

import json
import logging
import math
import time

import httpx
import numpy as np
import pytest

from deployments.requests.generations import parse_generation_request
from deployments.requests.replies import build_response
from dreamzero_client.errors import BadRequestError, ConfigError, InvalidObservation, PolicyServerError
from dreamzero_client.http_client import ActionClient
from dreamzero_client.wire import codec
from dreamzero_droid.links import HttpLink, OpenPILink
from dreamzero_droid.policy import DroidPolicy, LinkReply, PolicyCallError
from dreamzero_droid.rtc import DelayEstimator, RtcRequest, RtcSchedule, refused_fields, switch_jump
from dreamzero_franka.cli import DeployArgs, build_parser
from dreamzero_franka.common.loop import LoopConfig
from tests.support.franka import ScriptedTransport, chunk_near, make_runner
from tests.support.observations import droid_runtime_observation

H = 24


def as_tuple(req: RtcRequest | None):
    return (
        None
        if req is None
        else (req.prefix_len, req.exec_horizon, None if req.action_prefix is None else req.action_prefix.tolist())
    )


class RtcLink:
    """A Link that honours RTC like the server: chunk c has joints `c + 0.01 * row` and gripper column c (its
    number); with a client prefix its first d rows are the prefix's joints (new action i = old action s + i) and
    the rest continues them by 0.01 a row. `refuse` names a field to answer with 422 (an older server); `report`
    False leaves `rtc` out of the session report (a server that ignores it)."""

    name = "rtc-fake"

    def __init__(self, refuse: str | None = None, report: bool = True, error_type=BadRequestError):
        self.queries, self.refuse, self.report, self.error_type = [], refuse, report, error_type

    def send(self, query):
        self.queries.append(query)
        rtc = query.rtc
        if (
            rtc is not None
            and self.refuse is not None
            and (self.refuse != "action_prefix" or rtc.action_prefix is not None)
        ):
            if self.error_type is BadRequestError:
                raise BadRequestError(
                    f"unknown parameter {self.refuse}", 422, "invalid_observation", f"parameters.{self.refuse}"
                )
            raise self.error_type(f"'{self.refuse}' is not a valid key", code="invalid_observation", field=self.refuse)
        index = len(self.queries)
        actions = np.full((H, 8), float(index))
        actions[:, :7] += 0.01 * np.arange(H)[:, None]
        session = {"session_id": query.session_id, "step": index, "restarted": index == 1, "incarnation": "i1"}
        if rtc is not None:
            if rtc.action_prefix is not None:
                d = rtc.prefix_len
                actions[:d, :7] = rtc.action_prefix[:d, :7]
                actions[d:, :7] = actions[d - 1, :7] + 0.01 * np.arange(1, H - d + 1)[:, None]
            if self.report:
                session["rtc"] = "client_prefix" if rtc.action_prefix is not None else "session_cache"
        return LinkReply(actions, session)

    def reset(self, session_id):
        pass

    def close(self):
        pass


# 1. The delay estimate ----------------------------------------------------------------------------------------------
def test_delay_is_the_p90_of_recent_round_trips_in_control_steps_rounded_up():
    est = DelayEstimator(control_hz=10.0, quantile=0.9, window=4)  # 100 ms per step
    assert est.steps() is None
    est.add(200.0)
    assert est.steps() == 2  # exactly two periods: 2 steps, not 3
    est.add(201.0)
    assert est.steps() == 3
    for ms in (50.0, 50.0, 50.0, 50.0):  # the window forgets the slow ones
        est.add(ms)
    assert est.steps() == 1
    est.add(float("nan"))  # ignored
    assert est.steps() == 1
    with pytest.raises(ConfigError, match="control_hz"):
        DelayEstimator(0.0)


def test_the_schedule_bounds_d_and_names_a_fixed_delay_that_cannot_fit():
    sched = RtcSchedule(open_loop_horizon=8, control_hz=10.0)
    assert sched.delay(H) == 12  # no round trip yet: the cap, H // 2
    sched.add_latency(5000.0)
    assert sched.delay(H) == 12
    capped = RtcSchedule(8, 10.0, max_delay_steps=5)
    capped.add_latency(5000.0)
    assert capped.delay(H) == 5
    with pytest.raises(ConfigError, match="delay_steps = 13"):
        RtcSchedule(8, 10.0, delay_steps=13).delay(H)
    with pytest.raises(ConfigError, match="delay_steps"):
        RtcSchedule(8, 10.0, delay_steps=0)


# 2. The timeline ------------------------------------------------------------------------------------------------
def test_plan_sends_d_s_and_the_rest_of_the_chunk_at_row_s():
    chunk = np.arange(H * 8, dtype=np.float64).reshape(H, 8)
    sched = RtcSchedule(open_loop_horizon=8, control_hz=15.0, delay_steps=3)
    assert [sched.plan(chunk, row) for row in range(8)] == [None] * 8
    req = sched.plan(chunk, 8)
    assert (req.prefix_len, req.exec_horizon) == (3, 8)
    np.testing.assert_array_equal(req.action_prefix, chunk[8:])  # row i of the prefix = new action i
    # a delay longer than the open-loop horizon pushes s out: s = max(olh, d), and s <= H - d
    late = RtcSchedule(open_loop_horizon=4, control_hz=15.0, delay_steps=10)
    assert late.plan(chunk, 9) is None and late.plan(chunk, 10).exec_horizon == 10
    assert as_tuple(RtcSchedule(4, 15.0, delay_steps=12, send_prefix=False).plan(chunk, 12)) == (12, 12, None)
    # the delay estimate grew past this row's room: d shrinks to H - s
    grown = RtcSchedule(open_loop_horizon=20, control_hz=10.0)
    grown.add_latency(50.0)
    assert grown.plan(chunk, 19) is None
    grown.add_latency(900.0)  # d = 9 now: the threshold min(max(20, 9), 15) = 15 is behind row 20
    assert as_tuple(grown.plan(chunk, 20)) == (4, 20, chunk[20:].tolist())


def test_switch_at_row_d_when_on_time_later_when_late_and_at_h_minus_s_when_the_old_chunk_runs_out():
    chunk = np.zeros((H, 8))
    sched = RtcSchedule(open_loop_horizon=8, control_hz=15.0, delay_steps=3)
    sched.sent(sched.plan(chunk, 8), H)
    assert [sched.switch_row(ready=True) for _ in range(2)] == [None, None]  # k = 1, 2 < d: the old chunk runs
    assert sched.switch_row(ready=True) == 3  # k = d: new row d, right after old row s + d - 1
    assert sched.switched().exec_horizon == 8 and sched.pending is None

    sched.sent(sched.plan(chunk, 8), H)
    assert [sched.switch_row(ready=False) for _ in range(4)] == [None] * 4
    assert sched.switch_row(ready=True) == 5  # late by 2: time-aligned, new row 5 after old row 12
    sched.switched()

    sched.sent(sched.plan(chunk, 8), H)
    rows = [sched.switch_row(ready=False) for _ in range(16)]
    assert rows == [None] * 15 + [16]  # old rows 9..23 ran; then wait for the reply and start at H - s
    with pytest.raises(RuntimeError, match="pending"):
        sched.switched() and sched.switched()


def test_executed_actions_follow_the_documented_timeline_through_the_policy():
    """20 ticks of a loop on the schedule with a fake RTC server: request ticks, sent fields, rows executed."""
    link = RtcLink()
    policy = DroidPolicy(link, prompt="stack the cups")
    sched = RtcSchedule(open_loop_horizon=8, control_hz=15.0, delay_steps=3)
    chunk = policy.infer(droid_runtime_observation(0)).actions  # tick 0, synchronous
    row, pending, executed, requests = 0, None, [], []
    for tick in range(30):
        if tick:
            if pending is not None:
                new_row = sched.switch_row(ready=True)
                if new_row is not None:
                    sched.switched()
                    chunk, row, pending = pending.actions, new_row, None
            if pending is None and (asked := sched.plan(chunk, row)) is not None:
                pending = policy.send(policy.request(droid_runtime_observation(tick), rtc=asked))
                sched.sent(asked, len(chunk))
                requests.append(tick)
            else:
                policy.observe(droid_runtime_observation(tick))
        executed.append((tick, int(chunk[row, 7]), row, chunk[row].copy()))  # (tick, chunk number, row, action)
        row += 1
    assert requests == [8, 16, 24]  # one query every s = 8 ticks, as without RTC
    rows = [(c, r) for _, c, r, _ in executed]
    assert rows[:11] == [(1, r) for r in range(11)]  # chunk 1: rows 0..7, then 8..10 while chunk 2 computes
    assert rows[11:19] == [(2, r) for r in range(3, 11)]  # chunk 2 from row d = 3 on: rows 0..2 are skipped
    assert rows[19] == (3, 3)
    sent = [q.rtc for q in link.queries[1:]]
    assert [(r.prefix_len, r.exec_horizon) for r in sent] == [(3, 8)] * 3
    np.testing.assert_array_equal(sent[0].action_prefix[:, :7], 1.0 + 0.01 * np.arange(8, 24)[:, None].repeat(7, 1))
    np.testing.assert_array_equal(sent[1].action_prefix, link_chunk(link, 2)[8:])
    # old row s + d - 1, then new row d: exactly one step of the fake's motion at every tick, switches included
    steps = [switch_jump(a[3], b[3]) for a, b in zip(executed, executed[1:])]
    np.testing.assert_allclose(steps, 0.01 * np.sqrt(7))
    assert link.queries[1].frames[-1].images["wrist_image_left"][90, 160, 0] == 8 + 2  # frames of the request tick


def link_chunk(link: RtcLink, number: int) -> np.ndarray:
    """Chunk `number` as the fake answered it (answers are a function of the query)."""
    replay = RtcLink()
    replay.queries = link.queries[: number - 1]
    return np.asarray(replay.send(link.queries[number - 1]).actions)


# 3. The fields on the wire -------------------------------------------------------------------------------------
def test_openpi_message_carries_the_rtc_fields_as_one_row():
    policy = DroidPolicy(RtcLink(), prompt="p")
    policy.infer(droid_runtime_observation())
    prefix = np.ones((16, 8))
    query = policy.request(droid_runtime_observation(), rtc=RtcRequest(3, 8, prefix))
    msg = OpenPILink().message(query)
    assert msg["rtc_prefix_len"] == [3] and msg["rtc_exec_horizon"] == [8]
    assert msg["action_prefix"].shape == (1, 16, 8) and msg["action_prefix"].dtype == np.float32
    plain = OpenPILink().message(policy.request(droid_runtime_observation()))
    assert not {"rtc_prefix_len", "rtc_exec_horizon", "action_prefix"} & set(plain)


def _mock_client(handler) -> ActionClient:
    client = ActionClient("http://127.0.0.1:9", max_retries=0)
    client._http = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(handler))
    return client


def test_http_link_puts_the_rtc_fields_in_parameters():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        body, flavour = codec.decode_body(request.content, request.headers["content-type"])
        bodies.append(body)
        req = parse_generation_request(body, flavour)
        session = {"session_id": req.session_ids[0], "step": 1, "restarted": False, "restart_reason": None,
                   "frame_position": 0, "incarnation": "x", "rtc": "client_prefix"}  # fmt: skip
        data, ctype = codec.encode_body(build_response(req, np.zeros((1, H, 8)), [session]), flavour)
        return httpx.Response(200, content=data, headers={"Content-Type": ctype})

    policy = DroidPolicy(HttpLink(client=_mock_client(handler)), prompt="p")
    policy.infer(droid_runtime_observation())
    chunk = policy.send(policy.request(droid_runtime_observation(), rtc=RtcRequest(2, 8, np.full((16, 8), 0.5))))
    params = bodies[1]["parameters"]
    assert params["rtc_prefix_len"] == [2] and params["rtc_exec_horizon"] == [8]
    assert np.asarray(params["action_prefix"]).shape == (1, 16, 8)
    assert not {"rtc_prefix_len", "action_prefix"} & set(bodies[0]["parameters"])
    assert chunk.rtc == "client_prefix" and chunk.rtc_request.prefix_len == 2 and policy.rtc_fallback is None


def test_action_client_rtc_parameters_broadcast_and_per_row():
    client = ActionClient("http://127.0.0.1:9")
    params = client._rtc_parameters(2, 3, [8, None], np.zeros((4, 8)))
    assert params["rtc_prefix_len"] == [3, 3] and params["rtc_exec_horizon"] == [8, None]
    assert params["action_prefix"].shape == (4, 8)  # [P, D]: every row's
    assert client._rtc_parameters(2, None, None, [np.zeros((4, 8)), None])["action_prefix"][1] is None
    with pytest.raises(ValueError, match="action_prefix has 3 rows"):
        client._rtc_parameters(2, 3, None, np.zeros((3, 4, 8)))
    with pytest.raises(ValueError, match="rtc_exec_horizon has 1 entries"):
        client._rtc_parameters(2, None, [8], None)
    client.close()


# 4. Fallback ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("error_type", [BadRequestError, PolicyServerError])
def test_a_server_that_refuses_rtc_gets_plain_queries_and_a_warning(caplog, error_type):
    link = RtcLink(refuse="rtc_prefix_len", error_type=error_type)
    policy = DroidPolicy(link, prompt="p")
    policy.infer(droid_runtime_observation())
    with caplog.at_level(logging.WARNING, logger="dreamzero.clients.policy"):
        chunk = policy.send(policy.request(droid_runtime_observation(), rtc=RtcRequest(2, 8, np.zeros((16, 8)))))
    assert chunk.rtc_request is None and chunk.rtc is None and chunk.actions.shape == (H, 8)
    assert [q.rtc is None for q in link.queries] == [True, False, True]  # refused, then asked again without
    assert "rtc_prefix_len" in policy.rtc_fallback and "real-time chunking off" in caplog.text
    assert policy.request(droid_runtime_observation(), rtc=RtcRequest(2, 8)).rtc is None  # never sent again
    assert len([r for r in caplog.records if "real-time chunking off" in r.getMessage()]) == 1


def test_a_refused_prefix_only_drops_the_prefix():
    link = RtcLink(refuse="action_prefix")
    policy = DroidPolicy(link, prompt="p")
    policy.infer(droid_runtime_observation())
    chunk = policy.send(policy.request(droid_runtime_observation(), rtc=RtcRequest(2, 8, np.zeros((16, 8)))))
    assert chunk.rtc == "session_cache" and as_tuple(chunk.rtc_request) == (2, 8, None)
    assert as_tuple(link.queries[-1].rtc) == (2, 8, None) and policy.rtc_fallback is None
    assert (
        policy.request(droid_runtime_observation(), rtc=RtcRequest(2, 8, np.zeros((16, 8)))).rtc.action_prefix is None
    )


def test_a_server_that_ignores_rtc_is_detected_from_its_report(caplog):
    policy = DroidPolicy(RtcLink(report=False), prompt="p")
    policy.infer(droid_runtime_observation())
    with caplog.at_level(logging.WARNING, logger="dreamzero.clients.policy"):
        chunk = policy.send(policy.request(droid_runtime_observation(), rtc=RtcRequest(2, 8)))
    assert chunk.rtc is None and "ignored" in policy.rtc_fallback and "real-time chunking off" in caplog.text
    assert policy.request(droid_runtime_observation(), rtc=RtcRequest(2, 8)).rtc is None


def test_other_errors_are_not_swallowed_by_the_fallback():
    class Failing(RtcLink):
        def send(self, query):
            raise BadRequestError("observation.state.joint_position has NaN", 422, "invalid_observation",
                                  "input.observation.state.joint_position")  # fmt: skip

    policy = DroidPolicy(Failing(), prompt="p")
    with pytest.raises(PolicyCallError) as err:
        policy.send(policy.request(droid_runtime_observation(), rtc=RtcRequest(2, 8)))
    assert err.value.reason == "error_reply" and policy.rtc_fallback is None


def test_refused_fields_reads_the_field_the_message_and_the_cause_chain():
    assert refused_fields(BadRequestError("x", 422, None, "parameters.action_prefix[0]")) == {"action_prefix"}
    assert refused_fields(BadRequestError("rtc_exec_horizon: s outside [d, H - d]", 422)) == {"rtc_exec_horizon"}
    try:
        try:
            raise InvalidObservation("too long", field="rtc_prefix_len")
        except InvalidObservation as inner:
            raise PolicyCallError("error_reply", "InvalidObservation: too long") from inner
    except PolicyCallError as outer:
        assert refused_fields(outer) == {"rtc_prefix_len"}
    assert refused_fields(TimeoutError("no reply")) == set()


# 5. The Franka loop: prefetch with the measured delay ---------------------------------------------------------------
class SlowRtcTransport(ScriptedTransport):
    """The Franka tests' scripted server, with a report that says RTC was applied and a delay per call."""

    def __init__(self, delays_s):
        super().__init__()
        self.delays_s = list(delays_s)

    def send(self, query):
        index = len(self.calls)
        if index < len(self.delays_s):
            time.sleep(self.delays_s[index])
        reply = super().send(query)
        session = {"session_id": query.session_id, "step": index + 1, "restarted": index == 0}
        if query.rtc is not None:
            session["rtc"] = "client_prefix"
        return LinkReply(reply.actions, session)


def _franka_steps(tmp_path, transport, max_steps):
    runner, robot, _ = make_runner(
        transport, control_hz=10.0, max_steps=max_steps, rtc=True, log_dir=str(tmp_path), watchdog_timeout_s=2.0
    )
    result = runner.run_episode(0)
    assert result.status == "completed", result.reason
    lines = (tmp_path / "episode_0000" / "steps.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], robot, result


def test_franka_rtc_prefetches_with_the_measured_delay_and_switches_at_row_d(tmp_path):
    # 10 Hz (100 ms a tick); the first (synchronous) round trip takes ~250 ms, so d = 3, and the later ones are fast:
    # their replies are there long before tick 8 + d, so the switch must be exactly there
    transport = SlowRtcTransport([0.25])
    steps, robot, result = _franka_steps(tmp_path, transport, max_steps=24)
    d = math.ceil(result.latencies_ms[0] / 100.0)  # 3 unless this machine is very busy
    assert d >= 3
    asked = [(i, s["chunk_row"], s["rtc_request"]) for i, s in enumerate(steps) if "rtc_request" in s]
    assert asked[0] == (8, 8, {"prefix_len": d, "exec_horizon": 8}) and asked[1][0] == 16
    sent = transport.calls[1]
    assert sent["rtc_prefix_len"] == [d] and sent["rtc_exec_horizon"] == [8]
    assert sent["action_prefix"].shape == (1, 16, 8)
    np.testing.assert_allclose(  # the prefix sent at tick 8 is what chunk 1 still had to run from row 8
        sent["action_prefix"][0], np.asarray(chunk_near(transport.calls[0]["observation/joint_position"], 0))[8:]
    )
    # chunk 1 runs rows 0 .. 8 + d - 1 (the last d while chunk 2 computes); chunk 2 starts at row d on tick 8 + d
    assert [s["chunk_row"] for s in steps[: 8 + d + 4]] == [*range(8 + d), *range(d, d + 4)]
    assert steps[8 + d]["rtc_switch_row"] == d and steps[8 + d]["rtc_source"] == "client_prefix"
    assert result.server_calls == 3 and [c.kind for c in robot.commands].count("hold") == 1  # the last one only


def test_franka_rtc_late_reply_keeps_the_old_chunk_and_switches_to_the_row_of_that_tick(tmp_path):
    # first call fast (d = 1), second ~0.8 s: the old chunk runs on past s + d and the new one starts k rows in
    transport = SlowRtcTransport([0.0, 0.8, 0.0, 0.0])
    steps, robot, _ = _franka_steps(tmp_path, transport, max_steps=24)
    assert steps[8]["rtc_request"] == {"prefix_len": 1, "exec_horizon": 8}
    switch = next(i for i, s in enumerate(steps) if "rtc_switch_row" in s)
    k = switch - 8
    assert 3 <= k < 16 and steps[switch]["chunk_row"] == steps[switch]["rtc_switch_row"] == k
    assert [s["chunk_row"] for s in steps[:switch]] == list(range(switch))  # chunk 1 ran on, no hold
    assert [c.kind for c in robot.commands[:-1]].count("hold") == 0
    nxt = next(s for s in steps[switch:] if "rtc_request" in s)  # may leave on the switch tick itself
    assert nxt["rtc_request"]["prefix_len"] >= 4  # the estimate learnt the slow round trip


def test_franka_loop_config_rtc():
    with pytest.raises(ConfigError, match="loop.rtc"):
        LoopConfig(rtc=True, prefetch=True)
    with pytest.raises(ConfigError, match="loop.rtc_max_delay_steps"):
        LoopConfig(rtc=True, rtc_max_delay_steps=0)
    assert LoopConfig(rtc=True, open_loop_horizon=1).min_chunk_rows == 2


def test_franka_cli_rtc_flags():
    base = ["--server", "ws://127.0.0.1:1", "--prompt", "x", "--robot", "sim", "--cameras", "synthetic"]
    args = DeployArgs.from_namespace(build_parser().parse_args([*base, "--rtc", "--rtc-max-delay-steps", "6"]))
    assert args.loop.rtc and args.loop.rtc_max_delay_steps == 6 and not args.loop.prefetch
    with pytest.raises(ConfigError, match="loop.rtc"):
        DeployArgs.from_namespace(build_parser().parse_args([*base, "--rtc", "--prefetch"]))
