"""Admission by bytes (dreamzero.sessions / pipeline / policy): the footprint formula against real and meta-device
sessions, reservations, eviction of idle sessions, 503 for the request that does not fit and nobody else."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from dreamzero.errors import CapacityError
from dreamzero.sessions import SessionState, SessionStore


def _state(sid: str) -> SessionState:
    return SessionState(session_id=sid, prompt="p", negative_prompt="")


# ----------------------------------------------------------------------------------------------------------------------
# the store alone
# ----------------------------------------------------------------------------------------------------------------------


def test_admit_reserves_evicts_idle_and_refuses_only_what_cannot_fit():
    store = SessionStore(max_sessions=10, max_bytes=300, retry_after_s=7.0)
    for sid in ("a", "b", "c"):
        store.admit({sid: 100})
        store.put(_state(sid))
        store.release([sid])
    assert store.reserved_bytes() == 300 and store.stats()["reserved_bytes"] == 300
    store.admit({"a": 100})  # a live session already holding its reservation needs nothing more
    # "d" needs room: "b" is the least recently used idle session ("a" is admitted, so busy)
    store.admit({"d": 100})
    assert "b" not in store and store.lookup("b")[1] == "evicted" and store.reserved_bytes() == 300
    # "e" while a and d are in flight and c is queued: nothing idle, so only "e" is refused, with the budget named
    with pytest.raises(CapacityError, match="sessions.max_bytes") as info:
        store.admit({"e": 100}, busy=["c"])
    assert info.value.retry_after_s == 7.0 and store.refusals == 1
    assert {sid for sid in "acd" if sid in store} == {"a", "c"} and store.reserved_bytes() == 300  # untouched
    # all or nothing: a request of two sessions where only one would fit reserves neither
    store.release(["a", "d"])  # d never got stored: its reservation goes back
    assert store.reserved_bytes() == 200
    with pytest.raises(CapacityError):
        store.admit({"f": 100, "g": 150}, busy=["a", "c"])
    assert store.reserved_bytes() == 200 and "f" not in store._reserved


def test_store_without_admission_counts_what_sessions_hold():
    store = SessionStore(max_sessions=4)
    s = _state("a")
    s.kv_cache = [torch.zeros(2, 2, 5, 2, 4)]
    store.put(s)
    assert store.reserved_bytes() == s.nbytes() > 0
    store.drop(["a"])
    assert store.reserved_bytes() == 0


# ----------------------------------------------------------------------------------------------------------------------
# the formula
# ----------------------------------------------------------------------------------------------------------------------


def _droid_expected(k: int, vae_state: int, e: int = 2) -> int:
    """The documented formula (docs/model.md) written out for DROID 14B at 352x640, bf16, guided."""
    kv = 40 * 2 * 2 * (1 + 2 * k) * 880 * 5120 * e  # layers x (k, v) x branches x frames x tokens x dim
    text = 2 * 512 * 4096 * e
    clip = 257 * 1280 * e
    y_frames = min(3 + 2 * k, 9)
    y = 20 * y_frames * 44 * 80 * e
    first = 3 * 352 * 640 * e
    return kv + text + clip + y + (vae_state if y_frames < 9 else 0) + first


def test_droid_14b_footprint_on_the_meta_device_equals_the_formula_per_chunk():
    """A 14B session built on the meta device (nothing allocated) through the pipeline's own stages holds exactly the
    formula's bytes after every chunk, and peaks at ~10.1 GB before its window-full restart."""
    from dreamzero.config import preset
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.pipeline import DreamZeroPipeline
    from dreamzero.pipeline.conditioning import prefill_observed, start_sessions
    from dreamzero.pipeline.rows import resolve_rows
    from dreamzero.pipeline.timer import StageTimer
    from dreamzero.sessions import vae_state_nbytes

    cfg = preset("droid_14b")
    model = DreamZeroModel.from_config(cfg, device="meta").to(torch.bfloat16)
    model.model.fold_text_padding = False  # the fold reads values; meta tensors have none
    pipe = DreamZeroPipeline(model)
    hw = (352, 640)
    fp = pipe.footprint(hw)
    vae_state = vae_state_nbytes(cfg.vae, hw, torch.bfloat16, 2)
    assert len(fp.by_chunk) == 4  # frame positions 1, 3, 5, 7; the call at 9 restarts (window_full)
    assert list(fp.by_chunk) == [_droid_expected(k, vae_state) for k in range(4)]
    assert 10.0e9 < fp.peak < 10.2e9 and fp.peak == fp.by_chunk[-1]

    from dreamzero.pipeline.budget import warmup_batch

    batch = warmup_batch(pipe, 1, (8, 8))
    rows = resolve_rows(batch, pipe.store, pipe.dit_cfg.max_attention_frames, pipe.config.default_seed)
    state = rows[0].state
    state.text_cache = {b: torch.zeros(1, 512, 4096, device="meta", dtype=torch.bfloat16) for b in ("cond", "uncond")}
    frames = torch.zeros(1, 4, 3, *hw, device="meta")
    timer = StageTimer(torch.device("meta"))
    for k in range(len(fp.by_chunk)):
        if k == 0:
            start_sessions(pipe, rows, frames[:, -1], timer)
        else:
            rows[0] = dataclasses.replace(rows[0], restarted=False)
            prefill_observed(pipe, rows, frames, timer)
        state.current_start_frame += 2
        assert state.nbytes() == fp.by_chunk[k], f"chunk {k}: {fp.parts[k]}"


# ----------------------------------------------------------------------------------------------------------------------
# the tiny model through the pipeline and the policy
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy():
    from deployments.config.sections import SessionArgs
    from deployments.config.settings import PolicySettings
    from deployments.policy import PolicyDeployment

    pipeline = {"num_inference_steps": 2, "dit_step_mask": None}
    return PolicyDeployment(PolicySettings(sessions=SessionArgs(max_sessions=16), pipeline=pipeline))


def _request(pipe, sid: str, step: int | None = None):
    from dreamzero.pipeline.budget import warmup_batch, warmup_canvas_hw

    batch = warmup_batch(pipe, 1, warmup_canvas_hw(pipe), step or 0)
    batch.session_ids = [sid]
    batch.expected_steps = [step] if step is not None else None
    return batch


def test_tiny_sessions_hold_exactly_the_formula_chunk_by_chunk(policy):
    pipe = policy.pipeline
    fp = pipe.footprint((32, 64))
    assert len(fp.by_chunk) == 4 and fp.parts[0]["vae_state"] > 0 and fp.parts[-1]["vae_state"] == 0
    for k in range(len(fp.by_chunk) + 1):
        result = pipe.generate(_request(pipe, "fp", k or None))
        state, _ = pipe.store.lookup("fp")
        assert state.nbytes() == fp.by_chunk[k % len(fp.by_chunk)], f"chunk {k}"
    assert result.sessions[0].restart_reason == "window_full"  # the cycle closes where the formula says
    pipe.drop_sessions(["fp"])


def test_policy_refuses_only_the_request_that_does_not_fit(policy):
    from deployments.error_replies import classify

    pipe = policy.pipeline
    peak = pipe.footprint((32, 64)).peak
    pipe.store.max_bytes = int(2.5 * peak)  # room for two sessions
    try:
        run = lambda *reqs: asyncio.run(policy._generate_many(list(reqs)))  # noqa: E731
        first = run(_request(pipe, "s1"), _request(pipe, "s2"))
        assert all(o.error is None for o in first)
        # s3 is new: s2 (idle) is evicted for it; s1, in the same batch, is not
        second = run(_request(pipe, "s3"), _request(pipe, "s1", 1))
        assert all(o.error is None for o in second)
        assert "s2" not in pipe.store and "s1" in pipe.store and "s3" in pipe.store
        before = {sid: pipe.store.lookup(sid)[0] for sid in ("s1", "s3")}
        steps = {sid: s.step for sid, s in before.items()}
        # s4 is new while s1 and s3 are in flight in the same batch: s4 alone gets 503, its neighbours run on
        third = run(_request(pipe, "s4"), _request(pipe, "s1", 2), _request(pipe, "s3", 1))
        assert isinstance(third[0].error, CapacityError) and third[0].output is None
        reply = classify(third[0].error)
        assert reply.status == 503 and "Retry-After" in reply.headers() and "sessions.max_bytes" in reply.message
        for out, sid in zip(third[1:], ("s1", "s3")):
            assert out.error is None
            report = out.output.result.sessions[0]
            assert report.session_id == sid and not report.restarted and report.step == steps[sid] + 1
            assert out.output.batch_requests == 2  # the neighbours still shared one forward
        assert "s4" not in pipe.store and pipe.store.reserved_bytes() <= pipe.store.max_bytes
        assert pipe.store.stats()["refusals"] == 1
    finally:
        pipe.store.max_bytes = None
        pipe.drop_sessions(["s1", "s2", "s3", "s4"])


def test_request_larger_than_the_row_budget_gets_413(policy):
    from deployments.error_replies import classify
    from dreamzero.errors import PayloadTooLarge

    policy.admission.rows_per_request = 2
    try:
        batch = _request(policy.pipeline, "x")
        batch3 = dataclasses.replace(
            batch,
            images=np.repeat(batch.images, 3, 0),
            state=np.repeat(batch.state, 3, 0),
            state_mask=np.repeat(batch.state_mask, 3, 0),
            prompts=batch.prompts * 3,
            session_ids=["x", "y", "z"],
            expected_steps=None,
        )
        with pytest.raises(PayloadTooLarge, match="batching.rows_per_request=2") as info:
            asyncio.run(policy.generate(batch3))
        assert classify(info.value).status == 413
    finally:
        policy.admission.rows_per_request = None


def test_policy_budget_from_config(policy):
    store = policy.pipeline.store
    try:
        policy.engine.size_memory(4, "64MiB")
        assert store.max_bytes == 64 * 2**20 and store.retry_after_s == policy.settings.retry_after_s
        policy.engine.size_memory("auto", "auto")  # on a plain CPU, auto means no byte limit and CPU_AUTO_ROWS rows
        assert store.max_bytes is None and policy.engine.max_batch_rows == 16  # min(CPU_AUTO_ROWS, max_sessions)
        assert policy.info()["memory"] == {"rows": 16, "budget_bytes": None, "device": None, "total_bytes": None}
    finally:
        store.max_bytes = None


def test_ttl_never_expires_a_session_in_an_admitted_call():
    now = [0.0]
    store = SessionStore(max_sessions=4, ttl_s=10.0, clock=lambda: now[0], max_bytes=1000)
    store.admit({"a": 400})
    store.put(_state("a"))
    now[0] = 100.0  # idle far past the TTL, but its call is still running
    store.admit({"b": 400})
    assert "a" in store and store.reserved_bytes() == 800
    store.release(["a", "b"])
    store.lookup("a")  # expires now
    assert "a" not in store and store.reserved_bytes() == 0
