"""The serving pieces that need no graph: arg validation, the error table, batching plans, WebSocket frame buffers."""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np
import pytest
import torch
from ray import exceptions as ray_exc
from ray.serve import exceptions as serve_exc

from deployments.batch_merge import merge_batches, plan_groups, split_result
from deployments.config.sections import SessionArgs
from deployments.config.settings import PolicySettings
from deployments.doors.openpi_ws import WsSession, buffer_frames
from deployments.error_replies import classify, reply_response, ws_error_frame
from deployments.policy import PolicyDeployment
from deployments.requests.openpi import OpenPIRequest
from deployments.requests.rows import RowOptions
from deployments.routing import ws_session_id
from dreamzero import errors
from dreamzero.types import ChunkResult, ModelBatch, SessionReport
from serve_graph.builder import build_app, policy_options
from serve_graph.config import parse_app_args

# 1. Config ---------------------------------------------------------------------------------------------------------


def test_defaults_are_the_cpu_embedded_model():
    cfg = parse_app_args({})
    assert cfg.model_path is None and cfg.policy.num_gpus == 0 and cfg.resolved_device == "cpu"
    assert cfg.http.max_body_bytes == 64 * 1024 * 1024


@pytest.mark.parametrize(
    "args, needle",
    [
        ({"policy": {"num_gpuz": 1}}, "args.policy.num_gpuz: unknown field"),
        ({"pipeline": {"num_inference_step": 4}}, "Did you mean 'num_inference_steps'"),
        ({"model_path": "/nonexistent/ckpt"}, "args.model_path: '/nonexistent/ckpt' does not exist"),
        ({"device": "cuda"}, "set policy.num_gpus: 1"),
        ({"policy": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "raise max_replicas"),
        ({"api_key_env": "DREAMZERO_TEST_UNSET_KEY"}, "export it first"),
        ({"sessions": {"max_sessions": 0}}, "args.sessions.max_sessions"),
        ({"policy": {"torch_threads": 0}}, "args.policy.torch_threads"),
        ({"pipeline": {"prompt_cache_size": -1}}, "prompt_cache_size"),
        ({"tokenizer_path": "/nonexistent/umt5"}, "args.tokenizer_path"),
        ({"pipeline": {"dit_step_mask": [True, False]}}, "dit_step_mask has 2 entries"),
    ],
)
def test_invalid_args_fail_with_a_fix(args, needle):
    with pytest.raises(errors.ConfigError) as info:
        parse_app_args(args)
    assert needle in str(info.value)


def test_cpu_threads_grow_with_the_rows_of_a_call(monkeypatch):
    """One torch thread per `rows_per_thread` rows, at most `torch_threads`; set only when the count changes."""
    import torch

    from deployments.engine import CpuThreads

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    threads = CpuThreads(max_threads=2, rows_per_thread=4)
    assert [threads.use_for(n) for n in (1, 3, 4, 8, 16, 7, 1)] == [1, 1, 1, 2, 2, 1, 1]
    assert calls == [1, 2, 1]
    assert CpuThreads(3, 1).for_rows(2) == 2 and CpuThreads(3, 1).for_rows(9) == 3


def test_unknown_embodiment_fails_at_build_time():
    with pytest.raises(errors.ConfigError, match="oxe_droid"):
        build_app({"embodiment": "oxe_droidd"})


def test_policy_options_session_router_and_autoscaling():
    from serve_graph.session_router import SESSION_ROUTER

    opts = policy_options(parse_app_args({"policy": {"num_gpus": 1, "autoscaling": {"max_replicas": 4}}}))
    assert opts["ray_actor_options"]["num_gpus"] == 1
    assert opts["autoscaling_config"]["max_replicas"] == 4 and "num_replicas" not in opts
    assert opts["request_router_config"].request_router_class == SESSION_ROUTER


# 2. Error table ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc, status",
    [
        (errors.InvalidRequest("x"), 400),
        (errors.InvalidObservation("x", field="a.b"), 422),
        (errors.UnsupportedMediaType("x"), 415),
        (errors.PayloadTooLarge("x"), 413),
        (errors.Unauthorized("x"), 401),
        (errors.CapacityError("x", retry_after_s=2.5), 503),
        (errors.NotReady("x"), 503),
        (serve_exc.BackPressureError(num_queued_requests=3, max_queued_requests=2), 503),
        (asyncio.TimeoutError(), 503),
        (RuntimeError("secret internals"), 500),
    ],
)
def test_error_table(exc, status):
    reply = classify(exc)
    assert reply.status == status
    if status == 503:
        assert int(reply.headers()["Retry-After"]) >= 1
    if status == 500:
        assert "secret" not in reply.message
    if isinstance(exc, errors.InvalidObservation):
        assert reply.field == "a.b" and reply.body()["error"]["field"] == "a.b"


def test_ray_wrapped_errors_keep_their_field_and_retry_hint():
    cause = errors.InvalidObservation("bad", field="state.joint_position")
    wrapped = ray_exc.RayTaskError("generate", "traceback text", cause).as_instanceof_cause()
    assert classify(wrapped).status == 422 and classify(wrapped).field == "state.joint_position"
    resp = reply_response(classify(errors.CapacityError("full", retry_after_s=2.2)))
    assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
    frame = ws_error_frame(RuntimeError("boom"))
    assert frame == {"type": "error", "message": "Internal inference error", "code": "internal_error", "status": 500}


# 3. Routing keys ---------------------------------------------------------------------------------------------------


def test_ws_sessions_are_namespaced_by_connection():
    assert ws_session_id("c1", "default") != ws_session_id("c2", "default")


# 4. Batching -------------------------------------------------------------------------------------------------------


def _batch(ids, t=1, hw=(8, 16)):
    b = len(ids)
    return ModelBatch(
        images=np.zeros((b, t, *hw, 3), np.uint8), state=np.zeros((b, 1, 64), np.float32),
        state_mask=np.zeros((b, 1, 64), bool), prompts=["p"] * b, session_ids=list(ids),
    )  # fmt: skip


def test_plan_groups_merges_compatible_requests_and_keeps_session_order():
    batches = [_batch(["a"]), _batch(["b"]), _batch(["c"], t=4), _batch(["a"]), _batch(["d"]), _batch(["e"], t=4)]
    # a/b/d stack; c/e have 4 frames; the second "a" must come after the group holding the first one
    assert plan_groups(batches) == [[0, 1, 4], [2, 5], [3]]


def test_merge_and_split_round_trip():
    merged = merge_batches([_batch(["a", "b"]), _batch(["c"])], default_seed=1140)
    assert merged.session_ids == ["a", "b", "c"] and merged.images.shape[0] == 3
    assert merged.seeds == [1140] * 3 and merged.reset_mask == [False] * 3
    result = ChunkResult(
        actions=np.arange(3, dtype=np.float32)[:, None, None] * np.ones((3, 2, 4), np.float32),
        sessions=[SessionReport(s, 1, True, "new_session", 1) for s in "abc"],
    )
    first, second = split_result(result, [2, 1])
    assert first.actions.shape == (2, 2, 4) and second.actions[0, 0, 0] == 2.0
    assert [s.session_id for s in second.sessions] == ["c"]


class _CountingPipeline:
    """Records the rows of every model call; fails any call that holds the session "boom"."""

    def __init__(self):
        from dreamzero.config import preset
        from dreamzero.sessions import SessionStore

        self.action_horizon, self.max_action_dim = 24, 32
        self.config, self.calls = preset("tiny").pipeline, []
        self.store, self.device = SessionStore(), torch.device("cpu")

    def admit(self, batch, busy=()):
        self.store.admit({sid: 0 for sid in batch.session_ids}, busy)

    def generate(self, batch):
        self.calls.append(list(batch.session_ids))
        if "boom" in batch.session_ids:
            raise errors.CapacityError("no room")
        b = len(batch)
        reports = [SessionReport(s, 1, True, "new_session", 1) for s in batch.session_ids]
        return ChunkResult(actions=np.zeros((b, 24, 32), np.float32), sessions=reports)

    def stats(self):
        return self.store.stats()


def test_policy_loads_a_checkpoint_whose_tokenizer_lives_elsewhere(tmp_path):
    """`args.tokenizer_path` reaches the replica's loader: a checkpoint without tokenizer/ serves with it, and fails
    at start, saying how to get one, without it."""
    import torch

    from dreamzero.checkpoint import save_model
    from dreamzero.config import preset
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import build_local_tokenizer

    cfg = preset("tiny")
    save_model(DreamZeroModel.from_config(cfg, seed=3), tmp_path / "ckpt", save_tokenizer=False)
    build_local_tokenizer(cfg.text_encoder.vocab_size).save_pretrained(tmp_path / "tok")
    args = parse_app_args({"model_path": str(tmp_path / "ckpt"), "tokenizer_path": str(tmp_path / "tok")})
    sessions = SessionArgs(max_sessions=4)
    policy = PolicyDeployment(
        PolicySettings(model_path=args.model_path, tokenizer_path=args.tokenizer_path, sessions=sessions)
    )
    out = asyncio.run(policy.generate(_batch(["tok"])))
    assert out.result.actions.shape == (1, 24, 32) and torch.isfinite(torch.from_numpy(out.result.actions)).all()
    with pytest.raises(errors.CheckpointError, match="umt5-xxl"):
        PolicyDeployment(PolicySettings(model_path=args.model_path, sessions=sessions))


def test_one_failing_group_fails_only_its_own_requests(monkeypatch):
    import deployments.engine as engine_mod

    monkeypatch.setattr(engine_mod, "load_pipeline", lambda **kw: _CountingPipeline())
    policy = PolicyDeployment()
    batches = [_batch(["a"]), _batch(["b"]), _batch(["boom"], t=4)]
    outcomes = asyncio.run(policy._generate_many(batches))
    assert policy.pipeline.calls == [["a", "b"], ["boom"]]  # a and b shared one forward pass
    assert outcomes[0].output.batch_requests == 2 and outcomes[1].output.result.sessions[0].session_id == "b"
    assert isinstance(outcomes[2].error, errors.CapacityError) and outcomes[2].output is None


def test_batcher_lone_client_never_waits_and_closed_loop_clients_share_one_call():
    from deployments.batcher import ContinuousBatcher

    calls: list[list[str]] = []

    async def run(items):
        calls.append(list(items))
        await asyncio.sleep(0.02)  # the model call: requests arriving meanwhile queue for the next batch
        return [f"out-{x}" for x in items]

    async def client(batcher, name, rounds):
        return [await batcher.submit(f"{name}{r}") for r in range(rounds)]

    async def scenario():
        loop = asyncio.get_running_loop()
        lone = ContinuousBatcher(run, max_batch_size=8, wait_s=5.0)
        t0 = loop.time()
        assert await client(lone, "a", 3) == ["out-a0", "out-a1", "out-a2"]
        assert loop.time() - t0 < 1.0  # never waited the 5 s window for company
        calls.clear()
        group = ContinuousBatcher(run, max_batch_size=8, wait_s=5.0)
        await asyncio.gather(*(client(group, n, 3) for n in "abcd"))
        # the first call may start alone; from then on the four closed-loop clients share every call
        assert all(len(c) == 4 for c in calls[-2:]) and sum(map(len, calls)) == 12
        calls.clear()
        capped = ContinuousBatcher(run, max_batch_size=2, wait_s=0.0)
        await asyncio.gather(*(capped.submit(x) for x in "xyz"))
        assert [len(c) for c in calls] == [2, 1]

    asyncio.run(scenario())


def test_batcher_session_starts_wait_for_company_so_clients_that_start_together_batch_together():
    """A request that starts a session waits (at most wait_s, while requests keep arriving) for a full batch even at an
    idle model; without the rule the first arrival runs alone and its session stays out of step for good."""
    from deployments.batcher import ContinuousBatcher

    calls: list[list[str]] = []

    async def run(items):
        calls.append(list(items))
        await asyncio.sleep(0.01)
        return items

    async def staggered(batcher):  # four clients start 20 ms apart, as parallel environments reaching the server
        async def start(i):
            await asyncio.sleep(0.02 * i)
            return await batcher.submit(f"new-{i}")

        return await asyncio.gather(*(start(i) for i in range(4)))

    async def scenario():
        loop = asyncio.get_running_loop()
        starts = lambda item: item.startswith("new")  # noqa: E731
        assert await staggered(ContinuousBatcher(run, 4, wait_s=1.0, wants_company=starts)) == [
            f"new-{i}" for i in range(4)
        ]
        assert calls == [["new-0", "new-1", "new-2", "new-3"]]  # one batch as soon as it was full
        calls.clear()
        await staggered(ContinuousBatcher(run, 4, wait_s=1.0))
        assert calls[0] == ["new-0"]  # without the rule: a lone first call
        calls.clear()
        lone = ContinuousBatcher(run, 4, wait_s=0.4, wants_company=starts)
        t0 = loop.time()
        assert await lone.submit("new-x") == "new-x"
        assert 0.09 <= loop.time() - t0 < 0.35  # a lone start waits for one arrival gap (a quarter of wait_s)
        t0 = loop.time()
        assert await lone.submit("next") == "next"
        assert loop.time() - t0 < 0.04  # a continuing call of a lone client never waits
        calls.clear()
        returning = ContinuousBatcher(run, 4, wait_s=1.0, wants_company=starts)
        returning.expected = 3  # three clients were active: their gaps (> a quarter of wait_s) do not end the wait

        async def later(item, delay):
            await asyncio.sleep(delay)
            return await returning.submit(item)

        await asyncio.gather(later("new-a", 0.0), later("b", 0.3), later("c", 0.6))
        assert calls == [["new-a", "b", "c"]]

    asyncio.run(scenario())


def test_policy_treats_unknown_and_reset_sessions_as_session_starts(monkeypatch):
    import deployments.engine as engine_mod
    from deployments.policy import starts_session
    from dreamzero.sessions import SessionState, SessionStore

    pipeline = _CountingPipeline()
    pipeline.store = SessionStore()
    pipeline.store.put(SessionState(session_id="live", prompt="p", negative_prompt=""))
    monkeypatch.setattr(engine_mod, "load_pipeline", lambda **kw: pipeline)
    policy = PolicyDeployment()
    starts = lambda batch: starts_session(policy.engine.store, batch)  # noqa: E731 - what the batcher asks
    assert starts(_batch(["new"])) and starts(_batch(["live", "new"]))
    assert not starts(_batch(["live"]))
    reset = _batch(["live"])
    reset.reset_mask = [True]
    assert starts(reset)


def test_batcher_failure_reaches_only_that_batch_and_the_worker_survives():
    from deployments.batcher import ContinuousBatcher

    async def run(items):
        if "boom" in items:
            raise RuntimeError("model failed")
        return items

    async def scenario():
        batcher = ContinuousBatcher(run, max_batch_size=4, wait_s=0.0)
        with pytest.raises(RuntimeError, match="model failed"):
            await batcher.submit("boom")
        assert await batcher.submit("ok") == "ok"

        def broken_hint(item):
            raise KeyError(item)

        hinted = ContinuousBatcher(run, max_batch_size=4, wait_s=0.05, wants_company=broken_hint)
        assert await asyncio.wait_for(hinted.submit("ok"), 5) == "ok"  # a failing hint never stops the worker

    asyncio.run(scenario())


# 5. OpenPI frame buffering -----------------------------------------------------------------------------------------


def test_ws_frame_buffer_first_call_one_frame_then_last_four():
    s = WsSession("default", "ws-x:default")
    frame = lambda v: np.full((4, 6, 3), v, np.uint8)  # noqa: E731
    assert buffer_frames(s, "cam", frame(1), first_call=True).shape == (1, 4, 6, 3)
    out = buffer_frames(s, "cam", frame(2), first_call=False)
    assert out.shape == (4, 4, 6, 3) and out[:, 0, 0, 0].tolist() == [1, 1, 1, 2]  # short history: oldest repeated
    for v in (3, 4, 5):
        out = buffer_frames(s, "cam", frame(v), first_call=False)
    assert out[:, 0, 0, 0].tolist() == [2, 3, 4, 5]
    stack = np.stack([frame(v) for v in (10, 11, 12, 13)])
    assert buffer_frames(s, "cam", stack, first_call=False) is stack  # 4-frame stacks as sent
    assert isinstance(s.buffers["cam"], deque) and len(s.buffers["cam"]) == 4
    with pytest.raises(errors.InvalidObservation):
        buffer_frames(s, "cam", np.zeros((6, 3), np.uint8), first_call=False)
    fresh = WsSession("other", "ws-x:other")  # found by the live fuzz run: an empty stack was an IndexError (500)
    for first in (True, False):
        with pytest.raises(errors.InvalidObservation, match="T >= 1"):
            buffer_frames(fresh, "cam", np.zeros((0, 4, 6, 3), np.uint8), first_call=first)


def test_ws_request_carries_rtc_options_and_prefers_the_clients_continuity_echo():
    from deployments.doors.openpi_ws import to_generation_request
    from dreamzero_droid.droid import OPENPI_DROID_KEY_MAP

    s = WsSession("default", "ws-x:default")
    s.reset_next, s.last_step, s.last_incarnation = False, 4, "abc"
    obs = {k: np.zeros((180, 320, 3), np.uint8) for k in OPENPI_DROID_KEY_MAP if "image" in k}
    obs |= {"observation/joint_position": np.zeros(7, np.float32), "observation/gripper_position": np.zeros(1)}
    base = {"observation": obs, "reply_as_dict": True, "endpoint": "infer", "session_id": "default"}
    rows = RowOptions(["x"], ["default"], [False], rtc_prefix_len=[2], action_prefix=[np.zeros((2, 8))])
    out = to_generation_request(OpenPIRequest(**base, rows=rows), s, OPENPI_DROID_KEY_MAP).rows
    assert out.rtc_prefix_len == [2] and out.action_prefix[0].shape == (2, 8) and out.rtc_exec_horizon is None
    assert (out.expected_steps, out.expected_incarnations) == ([4], ["abc"])  # what the socket saw
    echoed = rows.replace(expected_steps=[9], expected_incarnations=["def"])
    out = to_generation_request(OpenPIRequest(**base, rows=echoed), s, OPENPI_DROID_KEY_MAP).rows
    assert (out.expected_steps, out.expected_incarnations) == ([9], ["def"])  # the client's echo wins
