"""Tenants without a cluster: the key table and its file, the namespacing of session ids, the token bucket and the
quotas a front door checks, the session store's tenant-aware eviction and session quota, and the ledger's sums."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

import pytest
import torch

from deployments.auth import tenant_from_header, tenant_from_token
from deployments.config.sections import TenantsArgs
from deployments.tenant_ledger import TenantLedger
from deployments.tenants import (
    DEFAULT_TENANT,
    KeyTable,
    TenantKeys,
    TenantQuotas,
    TokenBucket,
    audit_reports,
    key_digest,
    parse_door_config,
    parse_key_table,
    scoped_id,
    split_scoped,
    tenant_of,
)
from dreamzero.errors import ConfigError, QuotaExceeded, Unauthorized
from dreamzero.sessions import SessionState, SessionStore
from dreamzero.types import SessionReport
from serve_graph.config import parse_app_args


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


A_KEY, B_KEY = "key-of-team-a", "key-of-team-b"
TABLE = {"team-a": key_digest(A_KEY), "team-b": [key_digest("old-b"), key_digest(B_KEY)]}


# 1. Keys ------------------------------------------------------------------------------------------------------------


def test_a_digest_is_what_sha256sum_prints():
    assert key_digest("s3cret") == "sha256:" + hashlib.sha256(b"s3cret").hexdigest()
    upper = "sha256:" + hashlib.sha256(b"s3cret").hexdigest().upper()
    assert parse_key_table({"t": upper}) == {"t": (key_digest("s3cret"),)}  # any case, kept lower


def test_identify_names_the_tenant_of_each_key_and_nobody_else():
    table = KeyTable(parse_key_table(TABLE))
    assert table.identify(A_KEY) == "team-a"
    assert table.identify(B_KEY) == table.identify("old-b") == "team-b"  # both keys while B's is rotated
    for wrong in ("", None, "key-of-team-c", A_KEY + " ", A_KEY[:-1]):
        assert table.identify(wrong) is None


def test_identify_compares_against_every_entry(monkeypatch):
    """No early exit: a match in the first entry costs as many comparisons as no match at all."""
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    table = KeyTable(parse_key_table(TABLE))
    for key in (A_KEY, "nobody"):
        calls.clear()
        table.identify(key)
        assert len(calls) == 3


@pytest.mark.parametrize(
    "entries, needle",
    [
        ({"team-a": A_KEY}, "api_keys.team-a: give the key's digest as 'sha256:<64 hex digits>', not the key itself"),
        ({"team-a": "sha256:abc"}, "api_keys.team-a: 'sha256:' must be followed by 64 hex digits"),
        ({"Team A": key_digest(A_KEY)}, "api_keys: tenant name 'Team A': use 1-48 characters"),
        ({"team-a": []}, "api_keys.team-a: give at least one key digest"),
        ({"team-b": [key_digest("x"), 5]}, "api_keys.team-b[1]: give the key's digest"),
        ({"team-a": key_digest(A_KEY), "team-b": key_digest(A_KEY)}, "api_keys.team-b: this key is also the key of"),
        (["team-a"], "api_keys: must map tenant names"),
    ],
)
def test_a_bad_table_names_the_entry(entries, needle):
    with pytest.raises(ConfigError) as info:
        parse_key_table(entries)
    assert needle in str(info.value)
    assert A_KEY not in str(info.value).replace("'Team A'", "")  # a key given in clear is never echoed


def test_app_args_check_the_table_and_hash_the_legacy_key(tmp_path):
    cfg = parse_app_args({"api_key": "legacy", "api_keys": TABLE})
    assert cfg.key_digests == parse_key_table(TABLE) and cfg.api_key_digest == key_digest("legacy")
    keys = TenantKeys(cfg.key_digests, legacy=cfg.api_key_digest)
    assert keys.identify("legacy") == DEFAULT_TENANT and keys.identify(A_KEY) == "team-a"
    keys.replace_static({})  # a user_config's api_keys replace the table, not the legacy key
    assert keys.identify("legacy") == DEFAULT_TENANT and keys.identify(A_KEY) is None
    for args, needle in (
        ({"api_keys": {"team-a": A_KEY}}, "args.api_keys: team-a: give the key's digest"),
        ({"api_key": "x", "api_keys": {"default": key_digest("y")}}, "names too; drop one of them"),
        ({"api_keys": TABLE, "api_keys_file": str(tmp_path)}, "args.args: give api_keys or api_keys_file, not both"),
        ({"api_keys_file": str(tmp_path)}, "args.api_keys_file: "),  # the files are checked once the values agree
        ({"tenants": {"per_tenant": {"Bad": {}}}}, "args.tenants.per_tenant: tenant name 'Bad'"),
        ({"tenants": {"quota": {"requests_per_s": 0}}}, "args.tenants.quota.requests_per_s"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_app_args(args)
        assert needle in str(info.value), (args, str(info.value))
    bad = tmp_path / "keys.yaml"
    bad.write_text("team-a: [unclosed\n")
    with pytest.raises(ConfigError, match="args.api_keys_file: api_keys_file .* not YAML or JSON at line"):
        parse_app_args({"api_keys_file": str(bad)})


def test_no_key_at_all_makes_everyone_the_default_tenant():
    keys = TenantKeys({})
    assert not keys.required
    assert tenant_from_header(keys, None) == tenant_from_token(keys, "anything") == DEFAULT_TENANT


def test_header_schemes_and_refusals():
    keys = TenantKeys(parse_key_table(TABLE))
    assert tenant_from_header(keys, f"Bearer {A_KEY}") == "team-a"
    assert tenant_from_header(keys, f"Api-Key {B_KEY}") == "team-b"
    for header in (None, "", A_KEY, f"Basic {A_KEY}", "Bearer nope"):
        with pytest.raises(Unauthorized, match="missing or wrong API key"):
            tenant_from_header(keys, header)
    with pytest.raises(Unauthorized, match="api_token"):
        tenant_from_token(keys, None)


def test_the_key_file_is_read_again_when_it_changes(tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    path.write_text(f"team-a: {key_digest(A_KEY)}\n")
    clock = Clock(100.0)
    keys = TenantKeys({}, str(path), reload_s=5.0, clock=clock)
    assert keys.identify(A_KEY) == "team-a" and keys.identify(B_KEY) is None
    path.write_text(f'{{"team-a": "{key_digest("rotated-a")}", "team-b": "{key_digest(B_KEY)}"}}\n')  # JSON
    os.utime(path, ns=(10**18, 10**18))
    clock.now += 1.0
    assert keys.identify(A_KEY) == "team-a"  # looked at most every reload_s
    clock.now += 5.0
    assert keys.identify(A_KEY) is None and keys.identify("rotated-a") == "team-a" and keys.identify(B_KEY) == "team-b"
    # a broken edit keeps the keys read last, and the log names the problem, never a key
    path.write_text("team-a: plain-text-key\n")
    os.utime(path, ns=(2 * 10**18, 2 * 10**18))
    clock.now += 5.0
    with caplog.at_level(logging.ERROR, "dreamzero.serve.tenants"):
        assert keys.identify("rotated-a") == "team-a"
    assert "team-a: give the key's digest" in caplog.text and "plain-text-key" not in caplog.text
    path.unlink()
    clock.now += 5.0
    assert keys.identify("rotated-a") == "team-a" and keys.required


def test_a_door_user_config_replaces_the_args_keys_and_quotas():
    keys = TenantKeys(parse_key_table({"team-a": key_digest(A_KEY)}))
    table, quotas = parse_door_config({"api_keys": {"team-c": key_digest("c")}, "tenants": {"quota": {"burst": 2}}})
    keys.replace_static(table)
    assert keys.identify("c") == "team-c" and keys.identify(A_KEY) is None and quotas.quota.burst == 2
    keys.replace_static(None)  # a user_config without api_keys: the args table again
    assert keys.identify(A_KEY) == "team-a"
    with pytest.raises(ConfigError, match="user_config.api_keys.team-c: give the key's digest"):
        parse_door_config({"api_keys": {"team-c": "clear"}})
    with pytest.raises(ConfigError, match="user_config.tenant: unknown field"):
        parse_door_config({"tenant": {}})


# 2. Namespaces ------------------------------------------------------------------------------------------------------


def test_scoped_ids_keep_tenants_apart_and_come_back():
    assert scoped_id(DEFAULT_TENANT, "robot-1") == "robot-1"  # a single-key server sees the ids it always saw
    assert scoped_id("team-a", "robot-1") == "@team-a/robot-1"
    tricky = ["robot-1", "@team-a/robot-1", "@@x", "@", "a/b", "@team-a", "ws-1:default", "@/x"]
    seen = {}
    for tenant in (DEFAULT_TENANT, "team-a", "team-b"):
        for own in tricky:
            sid = scoped_id(tenant, own)
            assert sid not in seen, (tenant, own, seen.get(sid))  # no id of one tenant names another's session
            seen[sid] = (tenant, own)
            assert split_scoped(sid) == (tenant, own) and tenant_of(sid) == tenant


# 3. Quotas at the door ----------------------------------------------------------------------------------------------


def test_token_bucket_allows_a_burst_then_the_rate():
    clock = Clock()
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)  # one token every 0.5 s
    clock.now = 0.25
    assert bucket.take() == pytest.approx(0.25)
    clock.now = 0.5
    assert bucket.take() == 0.0 and bucket.take() > 0
    clock.now = 100.0
    assert [bucket.take() for _ in range(4)][-1] > 0  # saved tokens are capped at the burst


def test_door_quotas_per_tenant():
    clock = Clock()
    args = TenantsArgs.model_validate({
        "quota": {"requests_per_s": 1, "max_rows_per_request": 4},
        "per_tenant": {"eval": {"requests_per_s": 10, "burst": 20, "max_sessions_per_replica": 8}},
    })  # fmt: skip
    quotas = TenantQuotas(args, clock)
    assert quotas.quota("eval").max_rows_per_request == 4  # what eval does not set comes from `quota`
    quotas.admit("team-a", 4)
    with pytest.raises(QuotaExceeded) as info:
        quotas.admit("team-a", 1)
    assert info.value.quota == "requests_per_s" and info.value.retry_after_s == pytest.approx(1.0)
    assert "team-a" in str(info.value) and "1 requests/s" in str(info.value)
    for _ in range(20):
        quotas.admit("eval", 1)  # its own bucket: team-a's refusal costs it nothing
    with pytest.raises(QuotaExceeded) as info:
        quotas.admit("team-b", 5)
    assert info.value.quota == "max_rows_per_request" and info.value.retry_after_s is None
    assert quotas.session_limits("eval").per_replica == 8 and quotas.session_limits("team-a") is None
    quotas.update(TenantsArgs())
    for _ in range(50):
        quotas.admit("team-a", 100)  # defaults: no limit at all


# 4. The session store's groups ----------------------------------------------------------------------------------------


def _state(sid: str, kv_tokens: int = 0) -> SessionState:
    s = SessionState(session_id=sid, prompt="p", negative_prompt="n")
    if kv_tokens:
        s.kv_cache = [torch.zeros(2, 2, kv_tokens, 2, 4)]
    return s


def _tenant_store(**kwargs) -> tuple[SessionStore, list]:
    store = SessionStore(**kwargs)
    evicted = []
    store.group_of, store.on_evict = tenant_of, lambda sid, cause: evicted.append((sid, cause))
    return store, evicted


def test_count_eviction_takes_the_tenant_over_its_share_first():
    a = [scoped_id("eval", f"e{i}") for i in range(3)]
    b = [scoped_id("robots", f"r{i}") for i in range(2)]
    plain = SessionStore(max_sessions=4)
    store, evicted = _tenant_store(max_sessions=4)
    for s in (plain, store):
        for sid in [b[0], *a]:  # the robots' session is the least recently used of all
            s.put(_state(sid))
        s.put(_state(b[1]))
    assert b[0] not in plain and a[0] in plain  # plain LRU evicts the robots' session
    assert evicted == [(a[0], "lru")] and b[0] in store  # eval holds 3 of 4 slots (share 2): it pays
    assert store.group_counts() == {"eval": 2, "robots": 2}


def test_byte_admission_evicts_within_the_tenant_over_its_share():
    one = _state("x", 8).nbytes()
    store, evicted = _tenant_store(max_sessions=10, max_bytes=4 * one)
    robots = scoped_id("robots", "r0")
    for sid in [robots, *(scoped_id("eval", f"e{i}") for i in range(3))]:
        store.put(_state(sid, 8))
    store.admit({scoped_id("robots", "r1"): one})  # one more session's bytes: an eval session makes room
    assert evicted == [(scoped_id("eval", "e0"), "bytes")] and robots in store


def test_ttl_eviction_is_audited_with_its_cause():
    clock = Clock()
    store, evicted = _tenant_store(max_sessions=4, ttl_s=10.0, clock=clock)
    store.put(_state(scoped_id("eval", "e0")))
    clock.now = 11.0
    assert store.lookup(scoped_id("eval", "e0")) == (None, "evicted")
    assert evicted == [(scoped_id("eval", "e0"), "ttl")]


def test_session_quota_per_replica_and_in_total():
    clock = Clock()
    store, _ = _tenant_store(max_sessions=16, ttl_s=100.0, clock=clock)
    held = [scoped_id("eval", f"e{i}") for i in range(2)]
    for sid in held:
        store.put(_state(sid))
    clock.now = 30.0
    store.check_group_room(held, limit=2)  # continuing sessions ask for nothing
    store.check_group_room([scoped_id("robots", "r0")], limit=2)  # another tenant's count is its own
    with pytest.raises(QuotaExceeded) as info:
        store.check_group_room([*held, scoped_id("eval", "e2")], limit=2, label="tenant")
    err = info.value
    assert err.quota == "max_sessions_per_replica" and err.retry_after_s == pytest.approx(70.0)  # e0 expires then
    assert "tenant 'eval' holds 2 live session(s)" in str(err) and "robots" not in str(err)
    # the total counts the tenant's sessions on the other replicas; admitted (in-flight) sessions count too
    with pytest.raises(QuotaExceeded, match="holds 3 live session") as info:
        store.check_group_room([scoped_id("eval", "e2")], limit=None, total_limit=3, elsewhere=1)
    assert info.value.quota == "max_sessions"
    store.admit({scoped_id("eval", "e2"): 0})
    with pytest.raises(QuotaExceeded):
        store.check_group_room([scoped_id("eval", "e3")], limit=3)


def test_the_replay_policy_keeps_the_same_tenant_quotas_and_share_first_eviction():
    from deployments.replay import ReplayStore, _Cursor

    store = ReplayStore(max_sessions=4, retry_after_s=3.0)
    evicted = []
    store.group_of, store.on_evict = tenant_of, lambda sid, cause: evicted.append((sid, cause))
    a = [scoped_id("eval", f"e{i}") for i in range(3)]
    b = [scoped_id("robots", f"r{i}") for i in range(2)]
    for sid in [b[0], *a, b[1]]:  # the robots' first session is the least recently used of all
        store.cursors[sid] = _Cursor()
        store.evict_beyond_limit(sid)
    assert evicted == [(a[0], "lru")] and b[0] in store  # eval held 3 of 4 slots (share 2): it pays
    assert store.group_counts() == {"eval": 2, "robots": 2}
    store.check_group_room(a[1:], limit=2)  # continuing sessions ask for nothing
    with pytest.raises(QuotaExceeded, match="tenant 'eval' holds 2 live session") as info:
        store.check_group_room([scoped_id("eval", "e9")], limit=2, label="tenant")
    assert info.value.quota == "max_sessions_per_replica" and info.value.retry_after_s == 3.0
    with pytest.raises(QuotaExceeded, match="holds 5 live session") as info:
        store.check_group_room([scoped_id("robots", "r9")], limit=None, total_limit=5, elsewhere=3)
    assert info.value.quota == "max_sessions"


def test_a_quota_refusal_crosses_processes_whole():
    """Raised in a Policy replica, pickled by Ray to the door: the quota and the retry hint survive."""
    import pickle

    back = pickle.loads(pickle.dumps(QuotaExceeded("over", "max_sessions", 12.5)))
    assert (str(back), back.quota, back.retry_after_s, back.code) == ("over", "max_sessions", 12.5, "quota_exceeded")


def test_audit_lines_name_the_tenant_never_more(caplog):
    reports = [
        SessionReport(scoped_id("team-a", "arm"), 1, True, "new_session", 1, "i1"),
        SessionReport(scoped_id("team-a", "arm2"), 3, True, "window_full", 1, "i2"),  # the model's own restart
        SessionReport("legacy", 1, True, "reset_requested", 1, "i3"),
        SessionReport(scoped_id("team-b", "x"), 2, False, None, 2, "i4"),
    ]
    with caplog.at_level(logging.INFO, "dreamzero.audit"):
        audit_reports(reports, "replica-1")
    assert [r.getMessage() for r in caplog.records] == [
        "session start tenant=team-a session=arm replica=replica-1 reason=new_session",
        "session reset tenant=default session=legacy replica=replica-1 reason=reset_requested",
    ]


# 5. The ledger ------------------------------------------------------------------------------------------------------


def test_ledger_sums_the_other_replicas_and_forgets_silent_ones():
    clock = Clock()
    ledger = TenantLedger(stale_s=10.0, clock=clock)
    assert ledger.report("r1", {"eval": 2, "robots": 1}) == {}
    assert ledger.report("r2", {"eval": 3}) == {"eval": 2, "robots": 1}
    clock.now = 5.0
    assert ledger.report("r3", {}) == {"eval": 5, "robots": 1}
    clock.now = 12.0  # r1 and r2 silent for more than 10 s: gone (their replica died or was stopped)
    assert ledger.report("r3", {"eval": 1}) == {}


def test_ledger_link_refreshes_at_most_once_a_period_and_fails_open(caplog):
    import asyncio

    from deployments.tenant_ledger import LedgerLink

    clock, ledger, calls = Clock(), TenantLedger(), []

    class Remote:
        def __init__(self, fail: bool):
            self.fail = fail

        def remote(self, replica, counts):
            calls.append(replica)

            async def answer():
                if self.fail:
                    raise ConnectionError("ledger gone")
                return ledger.report(replica, counts)

            return answer()

    ledger.report("other-replica", {"farm": 3})
    link = LedgerLink("ledger", "me", lambda: {"farm": 1}, clock=clock)
    link._handle = lambda: type("Actor", (), {"report": Remote(False)})()
    asyncio.run(link.refresh())
    asyncio.run(link.refresh())  # within the period: no second call
    assert link.others == {"farm": 3} and calls == ["me"]
    link._handle = lambda: type("Actor", (), {"report": Remote(True)})()
    clock.now = 1.5
    with caplog.at_level(logging.WARNING, "dreamzero.serve.tenants"):
        asyncio.run(link.refresh())
    assert link.others == {} and "counting this replica's sessions only" in caplog.text


def test_a_slow_ledger_keeps_its_handle_and_a_dead_one_is_recreated(monkeypatch):
    """A ledger still starting (seconds under load) must not be dropped on a timeout: dropping the last handle ends
    a non-detached actor, so a ledger recreated on every timeout would never answer."""
    import asyncio

    from deployments import tenant_ledger
    from deployments.tenant_ledger import LedgerLink

    monkeypatch.setattr(tenant_ledger, "LEDGER_TIMEOUT_S", 0.05)
    clock = Clock()

    class Actor:
        def __init__(self, answer):
            self.answer = answer
            self.report = self

        def remote(self, replica, counts):
            return self.answer()

    async def slow():
        await asyncio.sleep(5)

    async def dead():
        raise ConnectionError("the ledger's owner died")

    link = LedgerLink("ledger", "me", lambda: {"farm": 1}, clock=clock)
    link._actor = starting = Actor(slow)
    asyncio.run(link.refresh())
    assert link._actor is starting and link.others == {}
    link._actor, clock.now = Actor(dead), 1.5
    asyncio.run(link.refresh())
    assert link._actor is None and link.others == {}
