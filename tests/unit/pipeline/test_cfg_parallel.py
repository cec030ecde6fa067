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
from dreamzero.errors import CapacityError, InvalidObservation
from dreamzero.pipeline import DreamZeroPipeline
from dreamzero.pipeline.cfg_parallel import BranchGroup, PeerLost, tcp_store
from dreamzero.sessions import SessionStore
from dreamzero.types import ModelBatch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

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


def groups(timeout_s: float, rank1=None) -> tuple[BranchGroup, object]:
    """A fresh gloo pair: (rank 0's group, what `rank1(port)` returns), both built at once on two threads (the gloo
    rendezvous waits for both); by default rank 1 is a plain BranchGroup."""
    master = tcp_store("127.0.0.1", 0, 0, timeout_s)
    if rank1 is None:

        def rank1(port):
            return BranchGroup(tcp_store("127.0.0.1", port, 1, timeout_s), 1, timeout_s=timeout_s)

    out, errors = run_both(lambda _: BranchGroup(master, 0, timeout_s=timeout_s), rank1, 0, master.port)
    assert not errors, errors
    return out[0], out[1]


def pair(models, overrides=None, timeout_s=30.0, max_sessions=8, store0=None):
    """Two pipelines on their own models, ranks 0 and 1 of a fresh gloo pair (`store0`: rank 0's session store)."""
    config = apply_overrides(models[0].config, overrides)
    gs = groups(timeout_s)
    stores = [store0 if store0 is not None else SessionStore(max_sessions), SessionStore(max_sessions)]
    return [DreamZeroPipeline(models[1 + r].model, config, stores[r], branch_group=gs[r]) for r in (0, 1)]


def step(pipes, b: ModelBatch):
    """One call on both ranks; rank 0's result (rank 1's actions are checked equal)."""
    out, errors = run_both(lambda p: p.generate(b), lambda p: p.generate(b), *pipes)
    assert not errors, errors
    np.testing.assert_array_equal(out[0].actions, out[1].actions)
    return out[0]


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
        assert pipes[0].branch_group.wait_s > 0 and pipes[1].branch_group.wait_s > 0
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
        # a restart that keeps the session's last chunk for real-time chunking (one frame: "single_frame") cannot be
        # followed by a rank 1 that lost the chunk: both restart it afresh, and the ranks steer the actions alike
        pipes[1].store.drop(["c"])
        got = step(pipes, batch(["c"], t=1, seed=10, rtc_prefix_len=[4]))
        assert [(s.restart_reason, s.rtc) for s in got.sessions] == [("evicted", "cold_start")]
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


def test_continuity_flags_resets_drops_and_ttl_are_rank0s(models, tiny):
    """Expected steps and incarnations, a reset and a drop asked of rank 0 alone (the replica's session control) and
    a TTL expiry of rank 0's store: every row restarts (or continues) as in one process, rank 1 follows, its store
    mirrors rank 0's, and the incarnations reported are rank 0's."""
    clock = [0.0]
    ref = DreamZeroPipeline(tiny.model, tiny.config, SessionStore(8, ttl_s=60.0, clock=lambda: clock[0]))
    pipes = pair(models, store0=SessionStore(8, ttl_s=60.0, clock=lambda: clock[0]))
    last = {"ref": {}, "pair": {}}  # side -> session -> its last report

    def call(ids, t, seed, expect=False, stale=()):
        """The same chunk on one process and on the pair; each side states its own last incarnations."""
        got = {}
        for side in ("ref", "pair"):
            kw = {}
            if expect:
                kw["expected_steps"] = [last[side][i].step for i in ids]
                kw["expected_incarnations"] = ["stale" if i in stale else last[side][i].incarnation for i in ids]
            b = batch(ids, t=t, seed=seed, **kw)
            got[side] = ref.generate(b) if side == "ref" else step(pipes, b)
            last[side].update({s.session_id: s for s in got[side].sessions})
        np.testing.assert_allclose(got["pair"].actions, got["ref"].actions, rtol=0, atol=ROUND_OFF)
        flags = [[(s.step, s.restarted, s.restart_reason, s.frame_position) for s in got[k].sessions] for k in got]
        assert flags[0] == flags[1], flags
        for s in got["pair"].sessions:
            assert s.incarnation == pipes[0].store.lookup(s.session_id)[0].incarnation
        assert set(pipes[1].store.ids()) == set(pipes[0].store.ids())
        return [s.restart_reason for s in got["pair"].sessions]

    try:
        assert call(["a", "b"], 1, 0) == ["new_session"] * 2
        inc_a = last["pair"]["a"].incarnation
        assert call(["a", "b"], 4, 1, expect=True) == [None, None]  # both expectations met: continue
        assert call(["a", "b"], 4, 2, expect=True, stale={"a"}) == ["step_mismatch", None]  # an old incarnation
        assert last["pair"]["a"].incarnation != inc_a
        for p in (ref, pipes[0]):  # the replica's session control reaches rank 0 only
            p.reset_sessions(["b"])
        assert call(["a", "b"], 4, 3) == [None, "reset_requested"]
        for p in (ref, pipes[0]):
            p.drop_sessions(["a"])
        assert call(["a", "b"], 4, 4) == ["new_session", None]
        clock[0] += 61.0  # "a" and "b" idle past the TTL: rank 0 expires them, rank 1 drops them at the next call
        assert call(["c"], 1, 5) == ["new_session"]
        assert set(pipes[1].store.ids()) == {"c"}
        assert call(["a", "c"], 4, 6) == ["evicted", None]
    finally:
        close(pipes)


def test_byte_budget_and_footprint_are_per_rank(models, tiny):
    """A rank holds one branch's KV cache and text rows, so one byte budget admits more sessions per rank than one
    process holding both; what each rank then holds stays within the footprint it admitted."""
    pipes = pair(models)
    try:
        one = DreamZeroPipeline(tiny.model, tiny.config, SessionStore(max_sessions=8))
        peak_one, peak_rank = one.footprint((H, W)).peak, pipes[0].footprint((H, W)).peak
        assert peak_rank < peak_one
        budget = 2 * peak_rank  # room for two sessions on a rank, for one in one process
        one.store.max_bytes = pipes[0].store.max_bytes = budget
        two = batch(["a", "b"], t=1)
        with pytest.raises(CapacityError):
            one.admit(two)
        pipes[0].admit(two)  # the replica admits on rank 0; rank 1 mirrors its sessions (and has no budget of its own)
        step(pipes, two)
        step(pipes, batch(["a", "b"], seed=1))
        for p in pipes:
            assert all(p.store.lookup(sid)[0].nbytes() <= peak_rank for sid in ("a", "b"))
        assert pipes[0].store.nbytes() == pipes[1].store.nbytes() <= budget
    finally:
        close(pipes)


def test_a_rank1_failure_mid_call_ends_rank1_and_bad_input_does_not(models):
    """`deployments.cfg_rank.CfgRank` (rank 1 of a served replica): bad input fails on both ranks before any exchange
    and the pair serves on; a failure of rank 1 after an exchange ends its process (here: recorded), since rank 0
    then waits in an exchange rank 1 will never join (and a closed socket fails it at once, a live process not)."""
    from deployments.cfg_rank import CfgRank

    left = []

    def rank1(port):
        rank = CfgRank({"device": "cpu", "dtype": "float32"}, "127.0.0.1", port, 5.0)
        rank._leave = lambda: left.append("left")  # the real one is os._exit
        rank.join(8)
        return rank

    g0, rank = groups(5.0, rank1)
    rank0 = DreamZeroPipeline(models[1].model, models[1].config, SessionStore(8), branch_group=g0)
    try:
        bad = batch(["a"], t=1)
        bad.state = bad.state[:, :, :10]  # the wrong state width: the input check names the field on both ranks
        out, errors = run_both(rank0.generate, rank.generate, bad, bad)
        assert isinstance(errors[0], InvalidObservation) and isinstance(errors[1], InvalidObservation)
        assert "state" in str(errors[0]) and not left
        good = batch(["a"], t=1)
        out, errors = run_both(rank0.generate, rank.generate, good, good)
        assert not errors and out[1] == out[0].dit_steps  # still in step

        def broken(*args, **kwargs):
            raise RuntimeError("rank 1's device failed")

        rank.pipeline._denoise = broken  # after the rows were agreed (an exchange): rank 0 now waits for its peer
        out, errors = run_both(rank0.generate, rank.generate, batch(["a"], seed=1), batch(["a"], seed=1))
        assert left == ["left"] and isinstance(errors[1], RuntimeError)
        assert isinstance(errors[0], PeerLost)  # within rank 0's timeout, never a hang
        assert "a" not in rank0.store  # never continued on half a state
    finally:
        g0.close()
        rank.pipeline.branch_group.close()


def test_the_pair_makes_one_warm_exchange_when_it_joins(models):
    """Building a group exchanges once on both process groups (NCCL's communicator is created there on a GPU): each
    rank knows its peer before any call, and nothing of that counts as a per-step exchange."""
    g0, g1 = groups(10.0)
    try:
        assert g0.peer == {"rank": 1, "branch": "uncond", "device": "cpu"}
        assert g1.peer == {"rank": 0, "branch": "cond", "device": "cpu"}
        assert g0.collectives == g1.collectives == 3 and g0.exchanges == g1.exchanges == 0  # two object, one tensor
        assert g0.broken is None and g1.broken is None
    finally:
        g0.close()
        g1.close()


def test_a_peer_that_leaves_before_the_warm_exchange_fails_the_join_not_a_call():
    """Rank 1 builds its process groups and leaves without the warm exchange (an init that failed there): rank 0's
    join raises PeerLost within its timeout, so a replica's start fails instead of its first robot's request."""

    def rank1(port):
        group = BranchGroup(tcp_store("127.0.0.1", port, 1, 5.0), 1, timeout_s=5.0, warm=False)
        group.close()
        return group

    master = tcp_store("127.0.0.1", 0, 0, 5.0)
    out, errors = run_both(lambda _: BranchGroup(master, 0, timeout_s=5.0), rank1, 0, master.port, limit_s=60.0)
    assert 1 in out and isinstance(errors.get(0), PeerLost), errors
    assert "rank 1" in str(errors[0])
