"""Session placement: holders keep their sessions, new sessions go where every router agrees, memo bridges the gap."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys

import pytest

from deployments.routing import STATS_KEYS, STATS_SESSIONS, HeldKeys
from dreamzero.types import ModelBatch
from serve_graph.session_router import (
    LastHolders,
    PlacementMemo,
    ReplicaView,
    SessionRouter,
    choose_replica,
    rendezvous_score,
    replica_view,
)


def _views(n: int, held: dict[str, set[str]] | None = None) -> list[ReplicaView]:
    held = held or {}
    return [ReplicaView(f"r{i}", frozenset(held.get(f"r{i}", ())), len(held.get(f"r{i}", ()))) for i in range(n)]


def test_a_held_session_stays_on_its_replica_whatever_is_added():
    keys = [f"robot-{i}" for i in range(40)]
    two = _views(2)
    placed = {k: choose_replica(k, two) for k in keys}
    held = {r: {k for k, v in placed.items() if v == r} for r in ("r0", "r1")}
    four = _views(4, held)  # r2, r3 are new and empty
    assert all(choose_replica(k, four) == placed[k] for k in keys)


def test_new_sessions_go_to_the_least_loaded_replicas():
    held = {"r0": {f"old-{i}" for i in range(16)}}
    views = _views(2, held)
    new = [choose_replica(f"new-{i}", views, load_slack=1) for i in range(8)]
    assert set(new) == {"r1"}


def test_placement_is_the_same_for_every_router_and_spreads_evenly():
    views = _views(4)
    a = [choose_replica(f"s{i}", list(views)) for i in range(400)]
    b = [choose_replica(f"s{i}", list(reversed(views))) for i in range(400)]  # another router, another order
    assert a == b
    counts = {r: a.count(r) for r in ("r0", "r1", "r2", "r3")}
    assert min(counts.values()) > 60, counts  # 100 each on average


def test_a_dead_replicas_sessions_move_once_and_stay():
    keys = [f"robot-{i}" for i in range(30)]
    three = _views(3)
    first = {k: choose_replica(k, three) for k in keys}
    survivors = [v for v in three if v.replica_id != "r2"]
    second = {k: choose_replica(k, survivors) for k in keys}
    moved = {k for k in keys if first[k] == "r2"}
    assert moved and all(second[k] != "r2" for k in moved)
    assert all(second[k] == first[k] for k in keys if k not in moved)
    # the survivors now report them; the replacement joins empty: nothing moves again
    held = {r: {k for k, v in second.items() if v == r} for r in ("r0", "r1")}
    with_replacement = [*_views(2, held), ReplicaView("r3")]
    assert all(choose_replica(k, with_replacement) == second[k] for k in keys)


def test_a_dead_replicas_orphans_go_to_the_same_survivor_whatever_the_counts_say():
    # two routers see the survivors' reports at different moments: one has r0's report of 6 re-placed sessions, the
    # other not yet. With the load filter they would part ways; an orphan is placed by the live set alone.
    keys = [f"robot-{i}" for i in range(40)]
    early = [ReplicaView("r0", frozenset({f"moved-{i}" for i in range(6)}), 6), ReplicaView("r1"), ReplicaView("r2")]
    late = [ReplicaView("r0"), ReplicaView("r1"), ReplicaView("r2")]
    a = [choose_replica(k, early, orphan=True) for k in keys]
    b = [choose_replica(k, late, orphan=True) for k in keys]
    assert a == b and set(a) == {"r0", "r1", "r2"}
    assert [choose_replica(k, early) for k in keys] != b  # what the load filter alone would have done


def test_last_holders_name_orphans_and_stay_bounded():
    holders = LastHolders(max_entries=3)
    holders.update([ReplicaView("r0", frozenset({"a", "b"}), 2), ReplicaView("r1", frozenset({"c"}), 1)])
    assert holders.is_orphan("a", ["r1"]) and not holders.is_orphan("a", ["r0", "r1"])
    assert not holders.is_orphan("never-seen", ["r1"])  # a new session is not an orphan
    holders.update([ReplicaView("r1", frozenset({"a"}), 1)])  # re-placed and reported on r1
    assert not holders.is_orphan("a", ["r1"])
    holders.update([ReplicaView("r2", frozenset({"d", "e"}), 2)])
    assert len(holders) == 3  # the oldest went


def test_two_holders_agree_on_one():
    views = [ReplicaView("a", frozenset({"k"}), 1), ReplicaView("b", frozenset({"k"}), 1), ReplicaView("c")]
    assert choose_replica("k", views) == choose_replica("k", list(reversed(views))) in {"a", "b"}


def test_recent_placement_wins_until_a_report_shows_the_key():
    views = _views(3)
    natural = choose_replica("k", views)
    other = next(v.replica_id for v in views if v.replica_id != natural)
    assert choose_replica("k", views, placed=other) == other
    assert choose_replica("k", [v for v in views if v.replica_id != other], placed=other) == natural  # placed died
    reported = [ReplicaView(v.replica_id, frozenset({"k"}) if v.replica_id == natural else frozenset()) for v in views]
    assert choose_replica("k", reported, placed=other) == natural


def test_no_replica_means_no_choice():
    assert choose_replica("k", []) is None


def test_memo_expires_and_is_bounded():
    now = [0.0]
    memo = PlacementMemo(ttl_s=5.0, clock=lambda: now[0], max_entries=3)
    memo.put("a", "r0")
    assert memo.get("a") == "r0"
    now[0] = 6.0
    assert memo.get("a") is None
    for k in "bcde":
        memo.put(k, "r1")
    assert len(memo) == 3 and memo.get("b") is None and memo.get("e") == "r1"
    memo.forget(["e"])
    assert memo.get("e") is None


def test_replica_view_reads_reports_defensively():
    assert replica_view("r", {STATS_KEYS: ["a", "b"], STATS_SESSIONS: 3}) == ReplicaView("r", frozenset({"a", "b"}), 3)
    assert replica_view("r", None) == ReplicaView("r", reported=False)  # joined, not polled yet
    assert replica_view("r", {STATS_KEYS: "not-a-list"}) == ReplicaView("r")


def test_rendezvous_score_does_not_depend_on_the_process_hash_seed():
    code = "from serve_graph.session_router import rendezvous_score as s; print(s('robot-1', 'abc'))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True,
            timeout=120, check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }  # fmt: skip
    assert outs == {str(rendezvous_score("robot-1", "abc"))}


def test_ray_router_api_is_what_we_build_on():
    """Fails loudly when a Ray upgrade changes the alpha/private router API this router subclasses."""
    from ray.serve.config import RequestRouterConfig
    from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

    assert issubclass(SessionRouter, ConsistentHashRouter) and issubclass(ConsistentHashRouter, RequestRouter)
    for name in ("choose_replicas", "update_replicas", "initialize_state", "_fulfill_pending_requests"):
        assert callable(getattr(ConsistentHashRouter, name, None)), name
    assert "num_fallback_replicas" in inspect.getsource(ConsistentHashRouter.initialize_state)
    assert isinstance(getattr(RunningReplica, "routing_stats", None), property)
    metadata_type = {f.name: f.type for f in dataclasses.fields(PendingRequest)}["metadata"]
    assert "RequestMetadata" in str(metadata_type)
    from ray.serve._private.common import RequestMetadata

    assert "session_id" in {f.name for f in dataclasses.fields(RequestMetadata)}
    fields = RequestRouterConfig.model_fields if hasattr(RequestRouterConfig, "model_fields") else {}
    for name in (
        "request_router_class", "request_router_kwargs", "request_routing_stats_period_s",
        "request_routing_stats_timeout_s",
    ):  # fmt: skip
        assert name in fields, name
    from ray.serve._private.constants import REQUEST_ROUTING_STATS_METHOD

    assert REQUEST_ROUTING_STATS_METHOD == "record_routing_stats"
    # sticky_call's fresh context: the routing loop indexes pending requests by internal id, one each (private)
    from ray.serve._private.request_router.request_router import RequestRouter as PrivateRouter

    assert "_pending_requests_by_id" in inspect.getsource(PrivateRouter._add_pending_request_to_indices)
    # a draining (STOPPING) replica leaves the broadcast at once: only RUNNING / PENDING_MIGRATION are routed to
    from ray.serve._private.deployment_state import DeploymentState

    running = inspect.getsource(DeploymentState.get_running_replica_infos)
    assert "ReplicaState.RUNNING" in running and "STOPPING" not in running


def _batch(sids: list[str], key: str | None = None) -> ModelBatch:
    n = len(sids)
    return ModelBatch(
        images=None, state=None, state_mask=None, prompts=["p"] * n, session_ids=sids, routing_key=key
    )  # fmt: skip


def test_held_keys_report_live_sessions_and_in_flight_keys_only():
    held = HeldKeys()
    a = held.enter(_batch(["s1", "s2"], key="env-0"))
    b = held.enter(_batch(["robot-7"]))  # no explicit key: the first session id, as the caller routed it
    assert (a, b) == ("env-0", "robot-7")
    assert held.live(set()) == (["env-0", "robot-7"], 0)  # in flight: reported before the store has them
    held.leave(a)
    held.leave(b)
    assert held.live({"s2", "robot-7"}) == (["env-0", "robot-7"], 2)
    assert held.live({"robot-7"}) == (["robot-7"], 1)  # env-0's sessions were evicted: forgotten
    assert held.live({"s1", "robot-7"}) == (["robot-7"], 1)  # and not resurrected by a stray id
    assert held.live(set()) == ([], 0)


def test_policy_options_route_by_session_router_with_stats():
    from serve_graph.builder import policy_options
    from serve_graph.config import parse_app_args
    from serve_graph.session_router import ROUTING_STATS_PERIOD_S, ROUTING_STATS_TIMEOUT_S, SESSION_ROUTER

    cfg = policy_options(parse_app_args({}))["request_router_config"]
    assert cfg.request_router_class == SESSION_ROUTER
    assert cfg.request_routing_stats_period_s == ROUTING_STATS_PERIOD_S
    assert cfg.request_routing_stats_timeout_s == ROUTING_STATS_TIMEOUT_S
    from deployments.policy import PolicyDeployment

    assert callable(getattr(PolicyDeployment, "record_routing_stats", None))  # the hook name Serve polls


@pytest.mark.parametrize("kwargs", [{"placement_ttl_s": 0}, {"placement_ttl_s": "x"}, {"load_slack": -1}])
def test_bad_router_kwargs_are_refused(kwargs):
    router = SessionRouter.__new__(SessionRouter)  # the kwargs check needs no Ray state
    with pytest.raises(ValueError):
        router.initialize_state(**kwargs)


def test_policy_generate_routes_by_the_key_and_carries_it_in_the_batch():
    from deployments.routing import policy_generate

    calls = []

    class Method:
        def __init__(self, key):
            self.key = key

        def remote(self, batch):
            calls.append((self.key, batch.routing_key))
            return "response"

    class Handle:
        def options(self, session_id):
            return type("Bound", (), {"generate": Method(session_id)})()

    batch = _batch(["s1", "s2"])
    assert policy_generate(Handle(), "env-0", batch) == "response"
    assert calls == [("env-0", "env-0")]  # the replica reports the very key the router placed


def test_a_replica_that_has_not_reported_yet_gets_no_new_session():
    held = {"r0": {"a"}, "r1": {"b"}}
    views = [*_views(2, held), ReplicaView("r2", reported=False)]  # r2 just joined: every router sees it unreported
    assert {choose_replica(f"new-{i}", views) for i in range(20)} <= {"r0", "r1"}
    assert choose_replica("x", [ReplicaView("r0", reported=False)]) == "r0"  # at start nobody reported yet
