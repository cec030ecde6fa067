"""Session placement on a real cluster: live sessions never move when the policy scales, a dead replica's sessions
restart exactly once, and every ingress replica sends a session to the same policy replica.

One app for the whole module: two ingress replicas (each with its own SessionRouter) in front of the policy, scaled
1 -> 2 -> 4 by config-only redeploys while the robots keep stepping, then one policy replica killed mid-round. Every
robot echoes the step and incarnation of its last reply, so any move of its state shows as a restart; every call is
bounded (httpx timeout, bounded rounds). The restart counts per scenario are in docs/reliability.md, "Session
placement".
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait

import httpx
import pytest

from tests.support.cluster import APP, BASE_ARGS, METRICS_URL, wait_replicas
from tests.support.request_builders import decode, normalised_body

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GEN = "/v1/actions/generations"
#: two ingress replicas; a policy arg of its own (ttl) so the next module's deploy starts policy replicas without the
#: sessions left here (new sessions go to the least-loaded replica: leftovers would skew their placement)
ARGS = {**BASE_ARGS, "ingress": {"num_replicas": 2}, "sessions": {**BASE_ARGS["sessions"], "ttl_s": 601}}
ROUND_TIMEOUT_S = 180
RETRIES = 20
#: restarts that mean the state was not where the robot's call went (the model's own reset rules, e.g. a full
#: context window every few chunks, restart sessions too, in place, and are not counted)
LOST_STATE = ("new_session", "step_mismatch", "evicted")


class Robots:
    """Single-session HTTP clients; each answer is checked and logged as (session, report, served_by)."""

    def __init__(self, http: httpx.Client, base: str):
        self.http, self.url = http, base + GEN
        self.step: dict[str, int] = {}
        self.incarnation: dict[str, str] = {}
        self.log: list[tuple[str, dict, str]] = []
        self._lock = threading.Lock()

    def _call(self, sid: str) -> None:
        for attempt in range(RETRIES):
            expected = self.step.get(sid)
            body = normalised_body(
                [sid],
                t=1 if expected is None else 4,
                expected_steps=None if expected is None else [expected],
                expected_incarnations=None if expected is None else [self.incarnation[sid]],
            )
            resp = self.http.post(self.url, content=body, headers={"content-type": "application/msgpack"})
            if resp.status_code == 503:  # a replica died or is starting: retryable by contract
                time.sleep(0.3 + 0.1 * attempt)
                continue
            assert resp.status_code == 200, (sid, resp.status_code, resp.content[:300])
            out = decode(resp.content)
            report = out["sessions"][0]
            if not report["restarted"]:  # continuity, checked on every answer: never a silent reuse
                assert expected is not None and report["step"] == expected + 1, (sid, expected, report)
                assert report["incarnation"] == self.incarnation[sid], (sid, report)
            else:
                assert report["step"] == 1 and report["restart_reason"], (sid, report)
            self.step[sid], self.incarnation[sid] = report["step"], report["incarnation"]
            with self._lock:
                self.log.append((sid, report, out["served_by"]))
            return
        raise AssertionError(f"{sid}: still 503 after {RETRIES} retries")

    def round(self, sids: list[str], during=None) -> None:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(self._call, sid) for sid in sids]
            if during is not None:
                during()
            done, pending = wait(futures, timeout=ROUND_TIMEOUT_S)
            assert not pending, f"{len(pending)} clients hung"
        for f in done:
            f.result()

    def replica_of(self, sid: str) -> str:
        return next(rep for s, _, rep in reversed(self.log) if s == sid)

    def restarts(self, since: int = 0) -> Counter:
        """Lost-state restarts per session in the log from `since`, the first call of a session not counted."""
        seen = {s for s, _, _ in self.log[:since]}
        out: Counter = Counter()
        for sid, report, _ in self.log[since:]:
            if sid in seen and report["restart_reason"] in LOST_STATE:
                out[sid] += 1
            seen.add(sid)
        return out


def _summary(restarts: Counter, affected: set[str]) -> str:
    per_affected = sorted(Counter(restarts.get(sid, 0) for sid in affected).items())
    others = sum(n for sid, n in restarts.items() if sid not in affected)
    return f"restarts per affected session (restarts, sessions) {per_affected}, restarts of the others {others}"


class Stepping:
    """Rounds of `sids` in a background thread until stopped: the robots keep running while the policy scales."""

    def __init__(self, robots: Robots, sids: list[str]):
        self.robots, self.sids, self.rounds = robots, sids, 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.robots.round(self.sids)
                self.rounds += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            self._error = exc

    def __enter__(self) -> Stepping:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(ROUND_TIMEOUT_S)
        assert not self._thread.is_alive(), "a stepping round hung"
        if self._error is not None:
            raise self._error


LIVE = [f"live-{i:02d}" for i in range(16)]


@pytest.fixture(scope="module")
def robots(http, serve_cluster, ensure_app):
    ensure_app(ARGS, replicas=1, policy_replicas=1)
    bots = Robots(http, serve_cluster[0])
    bots.round(LIVE)
    return bots


def _scale(serve_cluster, robots: Robots, n: int) -> set[str]:
    """Scale the policy to `n` replicas while the live robots step; returns the replicas that are new."""
    from ray import serve

    _, deploy = serve_cluster
    before = _policy_replicas(serve)
    with Stepping(robots, LIVE) as stepping:
        deploy(ARGS, wait_for=n, policy_replicas=n)
        time.sleep(2.5)  # two stats periods: every router has the new replicas' first reports
    assert stepping.rounds >= 1, "the robots should have stepped while the policy scaled"
    return _policy_replicas(serve) - before


def _policy_replicas(serve) -> set[str]:
    from ray.serve._private.common import ReplicaState

    deployment = serve.status().applications[APP].deployments["Policy"]
    assert set(deployment.replica_states) <= {ReplicaState.RUNNING}, deployment.replica_states
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Policy#" in a["name"]]
    return {n.rsplit("#", 1)[1] for n in names}


def test_scaling_up_moves_no_live_session_and_new_sessions_land_on_new_replicas(robots, serve_cluster):
    start = len(robots.log)
    owner = {sid: robots.replica_of(sid) for sid in LIVE}
    added = _scale(serve_cluster, robots, 2)
    assert len(added) == 1
    fresh = [f"new2-{i}" for i in range(4)]
    robots.round(LIVE + fresh)
    robots.round(LIVE + fresh)
    assert {robots.replica_of(sid) for sid in fresh} <= added, "new sessions belong on the new replica"

    added = _scale(serve_cluster, robots, 4)
    assert len(added) == 2
    fresh4 = [f"new4-{i}" for i in range(4)]
    robots.round(LIVE + fresh + fresh4)
    assert {robots.replica_of(sid) for sid in fresh4} <= added, "new sessions belong on the newest replicas"

    restarts = robots.restarts(start)
    print(f"scale 1->2->4: {len(LIVE)} live sessions, restarts {dict(restarts)}; new sessions {len(fresh + fresh4)}")
    assert restarts == Counter(), "a live session restarted while the policy scaled up"
    assert all(rep == owner[sid] for sid, _, rep in robots.log[start:] if sid in owner), "a live session moved"


def test_a_killed_replicas_sessions_restart_exactly_once(robots):
    import ray

    everyone = sorted({s for s, _, _ in robots.log})
    owner = {sid: robots.replica_of(sid) for sid in everyone}
    victim = Counter(owner.values()).most_common(1)[0][0]
    affected = {sid for sid, rep in owner.items() if rep == victim}

    def kill() -> None:
        time.sleep(0.2)  # the round is in flight
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#Policy#{victim}", namespace="serve"), no_restart=True)

    start = len(robots.log)
    robots.round(everyone, during=kill)
    robots.round(everyone)
    wait_replicas("Policy", 4, 120)  # Serve replaces the dead replica; the replacement joins empty
    time.sleep(2.5)
    robots.round(everyone)
    robots.round(everyone)

    restarts = robots.restarts(start)
    print(f"kill: {len(everyone)} sessions, {len(affected)} on the victim, {_summary(restarts, affected)}")
    assert set(restarts) == affected and set(restarts.values()) == {1}, (affected, restarts)
    for sid in affected:
        first_elsewhere = next(r for s, r, rep in robots.log[start:] if s == sid and rep != victim)
        assert first_elsewhere["restarted"] and first_elsewhere["restart_reason"] == "new_session", first_elsewhere
    assert all(rep == owner[sid] for sid, _, rep in robots.log[start:] if sid not in affected)
    assert victim not in {rep for _, _, rep in robots.log[-len(everyone) :]}


def test_both_ingress_replicas_route_a_session_to_the_same_policy_replica(robots):
    """Every reply of a session since its last placement names one replica, and both ingress replicas took calls."""
    everyone = sorted({s for s, _, _ in robots.log})
    start = len(robots.log)
    for _ in range(3):
        robots.round(everyone)
    served = {sid: {rep for s, _, rep in robots.log[start:] if s == sid} for sid in everyone}
    assert all(len(reps) == 1 for reps in served.values()), served
    assert robots.restarts(start) == Counter()
    assert len(_ingress_replicas_that_served()) >= 2  # both took calls (a replaced ingress adds a third id)


def _ingress_replicas_that_served(timeout_s: float = 30.0) -> set[str]:
    """Ingress replicas with a nonzero request counter on Ray's Prometheus endpoint (exported about every second)."""
    deadline, seen = time.monotonic() + timeout_s, set()
    with httpx.Client(timeout=10, trust_env=False) as client:
        while time.monotonic() < deadline:
            seen = set()
            for line in client.get(METRICS_URL["url"]).text.splitlines():
                if line.startswith("ray_serve_deployment_request_counter") and 'deployment="Ingress"' in line:
                    labels, value = line.rsplit(" ", 1)
                    if float(value) > 0 and 'replica="' in labels:
                        seen.add(labels.split('replica="', 1)[1].split('"', 1)[0])
            if len(seen) >= 2:
                break
            time.sleep(1.0)
    return seen


def test_scaling_down_restarts_only_the_removed_replicas_sessions_once(robots, serve_cluster):
    """Serve removes replicas of its choice; only their robots restart, once, flagged; nothing goes to them after."""
    from ray import serve

    everyone = sorted({s for s, _, _ in robots.log})
    owner = {sid: robots.replica_of(sid) for sid in everyone}
    start = len(robots.log)
    with Stepping(robots, everyone):
        serve_cluster[1](ARGS, wait_for=2, policy_replicas=2)
    removed = set(owner.values()) - _policy_replicas(serve)
    affected = {sid for sid, rep in owner.items() if rep in removed}
    assert affected, f"Serve removed replicas holding no session ({removed}); nothing was exercised"
    robots.round(everyone)
    restarts = robots.restarts(start)
    print(f"scale 4->2: {len(everyone)} sessions, {len(affected)} on removed replicas, {_summary(restarts, affected)}")
    assert set(restarts) == affected and set(restarts.values()) == {1}, (affected, restarts)
    for sid in affected:
        first_elsewhere = next(r for s, r, rep in robots.log[start:] if s == sid and rep not in removed)
        assert first_elsewhere["restarted"] and first_elsewhere["restart_reason"] == "new_session", first_elsewhere
    assert all(rep == owner[sid] for sid, _, rep in robots.log[start:] if sid not in affected)
    assert removed.isdisjoint(rep for _, _, rep in robots.log[-len(everyone) :])
