"""SessionStore: LRU / TTL eviction, eviction memory, accounting; SessionState byte counting."""

from __future__ import annotations

import threading

import pytest
import torch

from dreamzero.errors import ConfigError
from dreamzero.sessions import SessionState, SessionStore


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _state(sid: str, kv_tokens: int = 0) -> SessionState:
    s = SessionState(session_id=sid, prompt="pick", negative_prompt="bad")
    if kv_tokens:
        s.kv_cache = [torch.zeros(2, 2, kv_tokens, 2, 4) for _ in range(3)]  # 3 layers, cond + uncond rows
    return s


def test_lookup_reports_new_then_live():
    store = SessionStore(max_sessions=2)
    assert store.lookup("a") == (None, "new_session")
    store.put(_state("a"))
    state, reason = store.lookup("a")
    assert state.session_id == "a" and reason is None


def test_lru_eviction_never_fails_and_remembers():
    store = SessionStore(max_sessions=2)
    for sid in "abc":
        store.put(_state(sid))
        if sid == "b":
            store.lookup("a")  # a is now more recent than b
    assert len(store) == 2 and "b" not in store and "a" in store and "c" in store
    assert store.lookup("b") == (None, "evicted")
    assert store.stats()["evictions"] == 1
    store.put(_state("b"))  # re-created: no longer reported as evicted afterwards
    assert store.lookup("b")[1] is None


def test_protected_sessions_survive_eviction():
    store = SessionStore(max_sessions=2)
    store.put(_state("old"))
    store.put(_state("x"))
    store.put(_state("y"), protect=["old", "x", "y"])  # all protected: the oldest still goes, no error
    assert len(store) == 2 and "y" in store
    store.put(_state("z"), protect=["y", "z"])
    assert "z" in store and "y" in store


def test_ttl_expiry_uses_the_clock():
    clock = FakeClock()
    store = SessionStore(max_sessions=8, ttl_s=10.0, clock=clock)
    store.put(_state("a"))
    clock.now = 5.0
    store.put(_state("b"))
    clock.now = 12.0  # a idle for 12 s, b for 7 s
    assert store.lookup("a") == (None, "evicted")
    assert store.lookup("b")[1] is None
    clock.now = 30.0
    assert store.stats()["live"] == 0 and store.stats()["evictions"] == 2


def test_evicted_memory_is_bounded():
    store = SessionStore(max_sessions=1, remember_evicted=3)
    for i in range(6):
        store.put(_state(str(i)))
    assert store.lookup("4")[1] == "evicted" and store.lookup("0")[1] == "new_session"


def test_drop_is_not_an_eviction():
    store = SessionStore(max_sessions=4)
    store.put(_state("a"))
    assert store.drop(["a", "missing"]) == 1
    assert store.lookup("a") == (None, "new_session")
    assert store.stats()["evictions"] == 0


def test_bytes_and_restart_stats():
    store = SessionStore(max_sessions=4)
    s = _state("a", kv_tokens=5)
    s.text_cache = {"cond": torch.zeros(1, 512, 8)}
    expected = 2 * 3 * (2 * 1 * 5 * 2 * 4) * 4 + 512 * 8 * 4
    assert s.nbytes() == expected and s.kv_len() == 5
    store.put(s)
    store.record_restart("new_session")
    store.record_restart("window_full")
    stats = store.stats()
    assert stats["bytes"] == expected and stats["live"] == 1
    assert stats["restarts"]["new_session"] == 1 and stats["restarts"]["window_full"] == 1
    assert stats["restarts"]["evicted"] == 0
    with pytest.raises(ValueError, match="unknown restart reason"):
        store.record_restart("bored")


def test_byte_budget_evicts_idle_sessions_only():
    one = _state("x", kv_tokens=5).nbytes()
    store = SessionStore(max_sessions=10, max_bytes=int(2.5 * one))
    for sid in "abc":
        store.put(_state(sid, kv_tokens=5))
    assert "a" not in store and "b" in store and "c" in store
    assert store.lookup("a")[1] == "evicted" and store.stats()["bytes"] <= 2.5 * one
    # a batch bigger than the budget keeps its own sessions (the call needs them) and evicts everyone else
    store.put(_state("d", kv_tokens=5), protect=["d", "e", "f"])
    store.put(_state("e", kv_tokens=5), protect=["d", "e", "f"])
    store.put(_state("f", kv_tokens=5), protect=["d", "e", "f"])
    assert {sid for sid in "bcdef" if sid in store} == {"d", "e", "f"}


def test_bad_limits_fail():
    with pytest.raises(ConfigError, match="max_sessions"):
        SessionStore(max_sessions=0)
    with pytest.raises(ConfigError, match="ttl"):
        SessionStore(ttl_s=0)
    with pytest.raises(ConfigError, match="max_bytes"):
        SessionStore(max_bytes=0)


def test_concurrent_puts_keep_the_bound():
    store = SessionStore(max_sessions=5)

    def worker(k: int):
        for i in range(50):
            store.put(_state(f"{k}-{i}"))
            store.lookup(f"{k}-{i - 1}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(store) == 5 and store.stats()["evictions"] == 4 * 50 - 5
