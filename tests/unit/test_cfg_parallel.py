"""CFG-parallel inference (dreamzero/pipeline/cfg_parallel.py): two gloo ranks, one guidance branch each, against the
one-process loop on the real tiny model in fp32.

The ranks run as two threads of this process (a raw gloo process group over a TCP store, not the global default
group, so no subprocess is needed), each with its own copy of the model (a model is not shared between threads: the
VAE keeps its causal cache on the module) and its own session store.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dreamzero.config import apply_overrides
from dreamzero.pipeline import DreamZeroPipeline
from dreamzero.pipeline.cfg_parallel import BranchGroup, PeerLost, tcp_store
from dreamzero.sessions import SessionStore
from dreamzero.types import ModelBatch

H, W = 32, 64  # the tiny model's canvas
#: measured: fp32 actions of cfg_parallel 2 vs 1 differ by at most ~1.2e-6 (the DiT runs G rows instead of 2G,
#: which changes the matmul blocking only); the two ranks agree bit for bit. The bound leaves room for other CPUs.
ROUND_OFF = 2e-5


@pytest.fixture(scope="module")
def models():
    """The tiny model three times: the one-process reference, rank 0, rank 1."""
    return [DreamZeroPipeline.load(device="cpu", dtype="float32", max_sessions=8) for _ in range(3)]


@pytest.fixture
def tiny(models):
    return models[0]


def batch(ids, t=4, seed=0, **kw) -> ModelBatch:
    rng = np.random.default_rng(seed)
    n = len(ids)
    return ModelBatch(
        images=rng.integers(0, 256, (n, t, H, W, 3), dtype=np.uint8),
        state=rng.standard_normal((n, 1, 64)).astype(np.float32),
        state_mask=np.ones((n, 1, 64), bool),
        prompts=[f"pick up the block {i}" for i in ids],
        session_ids=list(ids),
        **kw,
    )


def pair(models, overrides=None, timeout_s=30.0, max_sessions=8):
    """Two pipelines on their own models, ranks 0 and 1 of a fresh gloo pair."""
    config = apply_overrides(models[0].config, overrides)
    master = tcp_store("127.0.0.1", 0, 0, timeout_s)
    groups: dict[int, BranchGroup] = {}

    def join(rank):  # both ranks must construct at once: the gloo rendezvous waits for the other
        store = master if rank == 0 else tcp_store("127.0.0.1", master.port, 1, timeout_s)
        groups[rank] = BranchGroup(store, rank, timeout_s=timeout_s)

    run_both(join, join)
    return [
        DreamZeroPipeline(models[1 + r].model, config, SessionStore(max_sessions=max_sessions), branch_group=groups[r])
        for r in (0, 1)
    ]


def run_both(fn0, fn1, arg0=0, arg1=1, limit_s=120.0):
    """fn0(arg0) and fn1(arg1) on two threads; (result0, result1) or the first error."""
    out, errors = {}, {}

    def call(rank, fn, arg):
        try:
            out[rank] = fn(arg)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the test's thread
            errors[rank] = exc

    threads = [threading.Thread(target=call, args=(r, f, a)) for r, f, a in ((0, fn0, arg0), (1, fn1, arg1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s)
        assert not t.is_alive(), "a rank hung"
    return out, errors


def close(pipes):
    for p in pipes:
        p.branch_group.close()


def sequence():
    """Several chunks of three sessions: new, continuing, reset, step mismatch, a late joiner, RTC, own seeds, a
    window that fills (restart `window_full`) and a batch of sessions at different frame positions."""
    return [
        batch(["a"], t=1, seed=0),
        batch(["a", "b"], seed=1, seeds=[7, 8]),
        batch(["a", "b"], seed=2, rtc_prefix_len=[4, None]),
        batch(["a", "b", "c"], seed=3, reset_mask=[False, True, False]),
        batch(["a", "b", "c"], seed=4, expected_steps=[4, 99, None]),
        batch(["a", "c"], seed=5),
        batch(["a", "b", "c"], seed=6, rtc_prefix_len=[8, 8, None]),
    ]


def reference(tiny, overrides, seq):
    ref = DreamZeroPipeline(tiny.model, apply_overrides(tiny.config, overrides), SessionStore(max_sessions=8))
    return [ref.generate(b) for b in seq]


@pytest.mark.parametrize(
    "overrides",
    [
        None,  # the upstream static step mask
        {"dynamic_skip": True, "dynamic_skip_warmup": 2, "dynamic_skip_thresholds": ((-1.0, 2),)},  # skips for sure
    ],
    ids=["static_mask", "dynamic_skip"],
)
def test_two_ranks_match_one_process(models, tiny, overrides):
    seq = sequence() if overrides is None else sequence()[:4]  # the second case only shows that skips agree
    expected = reference(tiny, overrides, seq)
    pipes = pair(models, overrides)
    try:
        out, errors = run_both(lambda p: [p.generate(b) for b in seq], lambda p: [p.generate(b) for b in seq],
                               pipes[0], pipes[1])  # fmt: skip
        assert not errors, errors
        for want, got0, got1 in zip(expected, out[0], out[1]):
            np.testing.assert_array_equal(got0.actions, got1.actions)  # both ranks: the same guided velocity
            np.testing.assert_allclose(got0.actions, want.actions, rtol=0, atol=ROUND_OFF)
            assert got0.dit_steps == got1.dit_steps == want.dit_steps  # the same skip decisions
            got = [(s.step, s.restarted, s.restart_reason, s.frame_position, s.rtc) for s in got0.sessions]
            assert got == [(s.step, s.restarted, s.restart_reason, s.frame_position, s.rtc) for s in want.sessions]
        reasons = {s.restart_reason for r in out[0] for s in r.sessions}
        assert {"new_session", "reset_requested"} <= reasons
        assert overrides or {"step_mismatch", "window_full"} <= reasons
        if overrides:
            assert expected[-1].dit_steps < tiny.config.num_inference_steps  # skipping did happen
        # each rank holds one branch: half the KV cache and text rows of the one-process session
        ref = DreamZeroPipeline(tiny.model, tiny.config, SessionStore())
        ref.generate(seq[0])
        one, half = ref.store.lookup("a")[0], pipes[0].store.lookup("a")[0]
        assert half.branches == ("cond",) and pipes[1].store.lookup("a")[0].branches == ("uncond",)
        assert one.kv_cache[0].shape[1] == 2 and half.kv_cache[0].shape[1] == 1
        assert set(pipes[0].store.lookup("a")[0].text_cache) == {"cond"}
        fp_one, fp_half = ref.footprint((H, W)).parts[-1], pipes[0].footprint((H, W)).parts[-1]
        assert fp_half["kv_cache"] * 2 == fp_one["kv_cache"] and fp_half["text"] * 2 == fp_one["text"]
        assert pipes[0].branch_group.exchanges == sum(r.dit_steps for r in out[0])
    finally:
        close(pipes)


def test_rank1_follows_rank0_sessions(models):
    """Eviction is rank 0's: rank 1 drops what rank 0 no longer holds; a state rank 1 lost restarts on both."""
    pipes = pair(models, max_sessions=2)
    try:
        steps = [batch(["a"], t=1), batch(["b"], t=1), batch(["c"], t=1)]  # rank 0 evicts "a" at "c"
        run_both(lambda p: [p.generate(b) for b in steps], lambda p: [p.generate(b) for b in steps], *pipes)
        assert set(pipes[0].store.ids()) == {"b", "c"}
        pipes[1].store.drop(["b"])  # rank 1 loses "b" (never happens by itself: it has no limits of its own)
        out, errors = run_both(lambda p: p.generate(batch(["a", "b", "c"], seed=9)),
                               lambda p: p.generate(batch(["a", "b", "c"], seed=9)), *pipes)  # fmt: skip
        assert not errors, errors
        assert [s.restart_reason for s in out[0].sessions] == ["evicted", "evicted", None]
        np.testing.assert_array_equal(out[0].actions, out[1].actions)
        assert set(pipes[1].store.ids()) == set(pipes[0].store.ids())
    finally:
        close(pipes)


def test_dead_peer_is_an_error_not_a_hang(models):
    """Rank 1 gone mid-call: rank 0's call fails with PeerLost within the timeout, its sessions are forgotten (they
    restart, flagged, wherever they go next), and every later call fails at once."""
    pipes = pair(models, timeout_s=5.0)
    try:
        run_both(lambda p: p.generate(batch(["a"], t=1)), lambda p: p.generate(batch(["a"], t=1)), *pipes)
        pipes[1].branch_group.close()  # rank 1 leaves: its process groups shut down
        with pytest.raises(PeerLost, match="rank 1"):
            pipes[0].generate(batch(["a"], seed=1))
        assert "a" not in pipes[0].store
        assert pipes[0].branch_group.broken
        with pytest.raises(PeerLost, match="unusable"):
            pipes[0].generate(batch(["a"], seed=2))
    finally:
        close(pipes)
