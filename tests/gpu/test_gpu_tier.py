"""The GPU tier (marked `gpu`: skipped with the reason where CUDA is absent, collected everywhere).

Run on one H200 by `scripts/gpu-check.sh` (which also runs the 14B latency benchmark). What it shows:
  - the tiny model's bf16 actions stay close to fp32 (drift printed and bounded);
  - the DROID 14B preset materialises with random weights directly on the GPU and runs a chunk at 8 and 16 steps
    (times printed, only sanity asserted);
  - a 14B session's measured `torch.cuda.memory_allocated` growth is within 5 % of its byte accounting, chunk by chunk;
  - with the measured `auto` budget, sessions are admitted until it is full, each driven to its fullest window, and
    the next one is refused with CapacityError: no OOM;
  - `serve run` with `policy.num_gpus: 1` answers the normalised and the raw form.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

CANVAS_14B = (352, 640)


def _tokenizer(model):
    from dreamzero.model.tokenizer import build_local_tokenizer

    model.text_encoder.tokenizer = build_local_tokenizer(model.config.text_encoder.vocab_size)
    return model


def _batch(pipe, sids, hw, step=0, frames=4, expected=None):
    from dreamzero.pipeline.budget import warmup_batch

    b = warmup_batch(pipe, len(sids), hw, step)
    b.session_ids = list(sids)
    if frames != b.images.shape[1]:
        b.images = b.images[:, -frames:]
    b.expected_steps = expected
    return b


def _sync():
    torch.cuda.synchronize()


@pytest.fixture(scope="module")
def pipe14b():
    from dreamzero.config import preset
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.pipeline import DreamZeroPipeline

    t0 = time.perf_counter()
    model = _tokenizer(DreamZeroModel.from_config(preset("droid_14b"), device="cuda", dtype=torch.bfloat16, seed=0))
    _sync()
    weights, took = torch.cuda.memory_allocated() / 2**30, time.perf_counter() - t0
    print(f"\n14B preset on {torch.cuda.get_device_name()}: {weights:.1f} GiB of weights in {took:.1f} s")
    pipe = DreamZeroPipeline(model)
    yield pipe
    del pipe, model
    torch.cuda.empty_cache()


def test_tiny_bf16_drift_from_fp32_is_bounded():
    # the CPU tests run the same comparison (tests/unit/test_bf16_drift.py, with bounds measured there)
    from tests.drift_support import drift, tiny_chunks

    out = tiny_chunks("cuda", chunks=4)  # fp32 weights built on CPU, then copied to the GPU at each dtype
    for k, (a32, a16) in enumerate(zip(out[torch.float32], out[torch.bfloat16])):
        d = drift(a32, a16)
        print(f"chunk {k}: bf16 vs fp32 {d}")
        assert np.isfinite(a16).all() and d.rel_l2 < 0.2, f"chunk {k}: bf16 drift {d.rel_l2:.3f} of the fp32 actions"


@pytest.mark.parametrize("steps", [8, 16])
def test_14b_chunk_runs_and_is_timed(pipe14b, steps):
    from dreamzero.config import apply_overrides

    mask = {"dit_step_mask": None} if steps == 16 else {}
    pipe = pipe14b
    saved = pipe.config
    pipe.config = apply_overrides(saved, {"num_inference_steps": 16, "dynamic_skip": False, **mask})
    try:
        sid = f"timed-{steps}"
        pipe.generate(_batch(pipe, [sid], CANVAS_14B, 0, frames=1))
        _sync()
        t0 = time.perf_counter()
        res = pipe.generate(_batch(pipe, [sid], CANVAS_14B, 1))
        _sync()
        ms = (time.perf_counter() - t0) * 1000
        print(f"\n14B bf16, {res.dit_steps} DiT steps: one continuing chunk {ms:.0f} ms; stages {res.timings_ms}")
        assert res.dit_steps == steps and np.isfinite(res.actions).all() and 0 < ms < 120_000
    finally:
        pipe.config = saved
        pipe.drop_sessions([f"timed-{steps}"])


def test_14b_session_memory_matches_its_accounting(pipe14b):
    pipe = pipe14b
    fp = pipe.footprint(CANVAS_14B)
    pipe._prompt_rows.clear()
    _sync()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    for k in range(len(fp.by_chunk)):
        res = pipe.generate(
            _batch(pipe, ["mem"], CANVAS_14B, k, frames=1 if k == 0 else 4, expected=[k] if k else None)
        )
        _sync()
        grown = torch.cuda.memory_allocated() - base
        state, _ = pipe.store.lookup("mem")
        held = state.nbytes()
        print(
            f"chunk {k}: allocated +{grown / 2**30:.3f} GiB, accounted {held / 2**30:.3f} GiB, formula "
            f"{fp.by_chunk[k] / 2**30:.3f} GiB"
        )
        assert not res.sessions[0].restarted or k == 0
        assert held == fp.by_chunk[k]
        assert abs(grown - held) <= 0.05 * held, f"chunk {k}: measured {grown} vs accounted {held}"
    pipe.drop_sessions(["mem"])


def test_14b_admission_fills_the_auto_budget_then_refuses_without_oom(pipe14b):
    from dreamzero.config import apply_overrides
    from dreamzero.errors import CapacityError
    from dreamzero.pipeline.budget import resolve_session_budget

    pipe = pipe14b
    saved = pipe.config
    pipe.config = apply_overrides(saved, {"num_inference_steps": 2, "dit_step_mask": None, "dynamic_skip": False})
    try:
        budget = resolve_session_budget("auto", pipe, rows=1, log=print)
        pipe.store.max_bytes = budget
        peak = pipe.footprint(CANVAS_14B).peak
        expected = budget // peak
        print(f"budget {budget / 2**30:.1f} GiB, session peak {peak / 2**30:.2f} GiB: {expected} sessions")
        admitted = []
        chunks = len(pipe.footprint(CANVAS_14B).by_chunk)
        for i in range(expected):
            sid = f"fill-{i}"
            for k in range(chunks):  # each session to its fullest window, so every admitted byte is really used
                pipe.generate(_batch(pipe, [sid], CANVAS_14B, k, frames=1 if k == 0 else 4))
            admitted.append(sid)
        free, total = torch.cuda.mem_get_info()
        print(
            f"after {len(admitted)} full sessions: {free / 2**30:.1f} GiB free of {total / 2**30:.1f}, peak "
            f"allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        )
        extra = _batch(pipe, ["fill-extra"], CANVAS_14B, 0, frames=1)
        # with every held session busy (in flight or queued), the next one is refused and nobody is touched
        with pytest.raises(CapacityError, match="sessions.max_bytes"):
            pipe.admit(extra, busy=admitted)
        pipe.store.release(["fill-extra"])
        assert all(sid in pipe.store for sid in admitted) and pipe.store.reserved_bytes() <= budget
        # with them idle, the least recently used one makes room, and the new session runs: still no OOM
        res = pipe.generate(extra)
        assert np.isfinite(res.actions).all() and "fill-0" not in pipe.store and "fill-extra" in pipe.store
        assert pipe.store.reserved_bytes() <= budget
    finally:
        pipe.config = saved
        pipe.store.max_bytes = None
        pipe.drop_sessions([f"fill-{i}" for i in range(64)])
        torch.cuda.empty_cache()


def test_serve_run_on_one_gpu_answers_both_forms(tmp_path):
    import httpx

    from dreamzero_client.wire import codec
    from dreamzero_client.wire.replies import parse_actions_response
    from dreamzero_client.wire.routes import GENERATIONS_PATH
    from tests.e2e.serve_process import ServeRun
    from tests.graph.helpers import content_type, decode, normalised_body, raw_body

    with ServeRun(tmp_path, args={"policy": {"num_gpus": 1}}) as server:
        with httpx.Client(timeout=300, trust_env=False) as client:
            for form, body in (("normalised", normalised_body(["gpu-n"])), ("raw", raw_body(["gpu-r"]))):
                r = client.post(
                    server.url + GENERATIONS_PATH, content=body, headers={"content-type": content_type(codec.OPENPI)}
                )
                assert r.status_code == 200, f"{form}: {r.status_code} {r.text[:500]}\n{server.log_tail()}"
                reply = parse_actions_response(decode(r.content))
                actions = np.asarray(reply.actions, dtype=np.float64)
                assert reply.form == form and actions.ndim == 3 and len(actions) == 1 and np.isfinite(actions).all()
