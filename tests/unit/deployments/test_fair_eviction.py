"""Tenant-fair eviction (issue 45, item 2): a tenant flooding new sessions evicts only its own idle sessions (or,
while it stays within its share, those of a tenant over its share), never another tenant's live session; by count
(`sessions.max_sessions`) and by bytes (`sessions.max_bytes`), in the model's store and in the replay's."""

from __future__ import annotations

import pytest
import torch

from deployments.replay import ReplayStore, _Cursor
from deployments.tenants import scoped_id, tenant_of
from dreamzero.errors import CapacityError
from dreamzero.sessions import SessionState, SessionStore


def _state(sid: str, kv_tokens: int = 0) -> SessionState:
    s = SessionState(session_id=sid, prompt="p", negative_prompt="n")
    if kv_tokens:
        s.kv_cache = [torch.zeros(2, 2, kv_tokens, 2, 4)]
    return s


def _store(**kwargs) -> tuple[SessionStore, list]:
    evicted: list = []
    store = SessionStore(**kwargs, group_of=tenant_of, on_evict=lambda sid, cause: evicted.append((sid, cause)))
    return store, evicted


def _serve(store: SessionStore, ids: list[str], kv_tokens: int = 0, need: int = 0) -> None:
    """One request as the pipeline runs it: admit, store every row (the batch protected), release."""
    store.admit({sid: need for sid in ids})
    try:
        for sid in ids:
            store.put(_state(sid, kv_tokens), protect=ids)
    finally:
        store.release(ids)


def test_a_flood_by_count_never_evicts_another_tenants_session():
    store, evicted = _store(max_sessions=16)
    others = [scoped_id("alpha", "a0"), scoped_id("beta", "b0")]
    _serve(store, others)
    flood = [scoped_id("flood", f"f{i}") for i in range(16)]
    with pytest.raises(CapacityError, match=r"sessions.max_sessions=16") as info:
        _serve(store, flood)  # 16 rows: 2 slots short, and alpha and beta are within their share
    assert "never evicted" in str(info.value) and "alpha" not in str(info.value)
    assert evicted == [] and len(store) == 2
    _serve(store, flood[:14])  # what fits
    more = [scoped_id("flood", f"g{i}") for i in range(14)]
    _serve(store, more)  # then its new rows evict its own idle sessions, oldest first
    assert evicted == [(sid, "lru") for sid in flood[:14]]
    for sid in others:  # their next step continues: never `evicted`
        state, reason = store.lookup(sid)
        assert state is not None and reason is None


def test_storing_without_admission_never_takes_another_tenants_session():
    store, evicted = _store(max_sessions=4)
    store.put(_state(scoped_id("alpha", "a0")))
    rows = [scoped_id("flood", f"f{i}") for i in range(4)]
    for sid in rows:  # every row of the flood's batch protected: its own oldest row goes, alpha's never
        store.put(_state(sid), protect=rows)
    assert scoped_id("alpha", "a0") in store
    assert [cause for _, cause in evicted] == ["lru"] and tenant_of(evicted[0][0]) == "flood"


def test_an_under_share_tenant_still_takes_room_from_one_over_its_share():
    store, evicted = _store(max_sessions=4)
    _serve(store, [scoped_id("eval", f"e{i}") for i in range(4)])  # eval holds every slot
    _serve(store, [scoped_id("robots", "r0"), scoped_id("robots", "r1")])  # 2 of 4 with them: its share
    assert sorted(sid for sid, _ in evicted) == [scoped_id("eval", "e0"), scoped_id("eval", "e1")]
    _serve(store, [scoped_id("robots", "r2")])  # a third row would take robots past its share: its own goes
    assert evicted[-1] == (scoped_id("robots", "r0"), "lru")
    assert store.group_counts() == {"eval": 2, "robots": 2}


def test_a_flood_by_bytes_never_evicts_another_tenants_session():
    one = _state("x", 8).nbytes()
    store, evicted = _store(max_sessions=64, max_bytes=10 * one)
    others = [scoped_id("alpha", "a0"), scoped_id("alpha", "a1"), scoped_id("beta", "b0")]
    _serve(store, others, kv_tokens=8, need=one)
    flood = [scoped_id("flood", f"f{i}") for i in range(10)]
    reserved = store.reserved_bytes()
    with pytest.raises(CapacityError, match="sessions.max_bytes") as info:
        store.admit({sid: one for sid in flood})  # a tenant holding nothing asks 10 rows: refused, nothing touched
    assert "never evicted" in str(info.value)
    assert evicted == [] and store.reserved_bytes() == reserved and store.stats()["refusals"] == 1
    _serve(store, flood[:7], kv_tokens=8, need=one)  # what fits
    _serve(store, [scoped_id("flood", f"g{i}") for i in range(3)], kv_tokens=8, need=one)
    assert evicted == [(sid, "bytes") for sid in flood[:3]]  # its own oldest, for bytes
    for sid in others:
        assert store.lookup(sid)[1] is None


def test_the_replay_store_keeps_the_same_rule():
    evicted: list = []
    store = ReplayStore(16, 2.0, group_of=tenant_of, on_evict=lambda sid, cause: evicted.append((sid, cause)))

    def serve(ids):  # as ReplayPipeline: admission, then each row answered and stored in turn
        store.check_room(ids)
        for sid in ids:
            store.cursors[sid] = store.cursors.pop(sid, None) or _Cursor()
            store.evict_beyond_limit(sid, ids)

    others = [scoped_id("alpha", "a0"), scoped_id("beta", "b0")]
    serve(others)
    flood = [scoped_id("flood", f"f{i}") for i in range(16)]
    with pytest.raises(CapacityError, match="sessions.max_sessions=16") as info:
        serve(flood)
    assert info.value.retry_after_s == 2.0 and evicted == []
    serve(flood[:14])
    serve([scoped_id("flood", f"g{i}") for i in range(14)])
    assert evicted == [(sid, "lru") for sid in flood[:14]]
    assert all(sid in store and not store.was_evicted(sid) for sid in others)
    # answering without admission: the flood's own rows go, never alpha's
    rows = [scoped_id("flood", f"h{i}") for i in range(16)]
    for sid in rows:
        store.cursors[sid] = _Cursor()
        store.evict_beyond_limit(sid, rows)
    assert all(sid in store for sid in others)
