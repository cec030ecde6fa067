"""Sessions across policy replicas on a real cluster: stickiness, a killed replica, scaling up and down.

Invariant checked on every answer: a session either continues (not restarted, step = the previous step + 1) or
says it restarted and why. Clients send the step and incarnation they expect, so stale state left on a replica is
never reused silently (a stale copy at the same step: test_stale_same_step.py; placement while scaling and the
restart counts: test_session_router.py).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from tests.support.cluster import APP, BASE_ARGS, wait_replicas
from tests.support.request_builders import decode, normalised_body

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GEN = "/v1/actions/generations"
SESSIONS = [f"robot-{i:02d}" for i in range(20)]
ROUND_TIMEOUT_S = 300
MAX_503_RETRIES = 20


class Fleet:
    """20 single-session clients; remembers each session's last step and replica, and checks every answer."""

    def __init__(self, http, base: str):
        self.http, self.base = http, base
        self.last_step: dict[str, int | None] = dict.fromkeys(SESSIONS)
        self.incarnation: dict[str, str | None] = dict.fromkeys(SESSIONS)
        self.replica: dict[str, str] = {}
        self.log: list[tuple[str, dict, str]] = []  # (session, report, replica) of every 200

    def _step(self, sid: str) -> tuple[dict, str]:
        expected, incarnation = self.last_step[sid], self.incarnation[sid]
        for attempt in range(MAX_503_RETRIES):
            body = normalised_body(
                [sid],
                t=1 if expected is None else 4,
                expected_steps=None if expected is None else [expected],
                expected_incarnations=None if incarnation is None else [incarnation],
            )
            resp = self.http.post(self.base + GEN, content=body, headers={"content-type": "application/msgpack"})
            if resp.status_code == 503:  # replica died / restarting: retryable by contract
                assert int(resp.headers["retry-after"]) >= 1
                time.sleep(0.5 + 0.1 * attempt)
                continue
            assert resp.status_code == 200, (sid, resp.status_code, resp.content[:300])
            out = decode(resp.content)
            return out["sessions"][0], out["served_by"]
        raise AssertionError(f"{sid}: still 503 after {MAX_503_RETRIES} retries")

    def round(self, during=None) -> dict[str, tuple[dict, str]]:
        with ThreadPoolExecutor(8) as pool:
            futures = {pool.submit(self._step, sid): sid for sid in SESSIONS}
            if during is not None:
                during()
            done, pending = wait(futures, timeout=ROUND_TIMEOUT_S)
            assert not pending, f"{len(pending)} clients hung"  # no client may hang, whatever happened
        results = {futures[f]: f.result() for f in done}
        for sid, (report, replica) in results.items():
            prev = self.last_step[sid]
            if not report["restarted"]:
                assert prev is not None and report["step"] == prev + 1, (sid, prev, report)  # never silent reuse
                assert report["incarnation"] == self.incarnation[sid], (sid, report)  # the very same state
            else:
                assert report["step"] == 1 and report["restart_reason"], report
            self.last_step[sid] = report["step"]
            self.incarnation[sid] = report["incarnation"]
            self.replica[sid] = replica
            self.log.append((sid, report, replica))
        return results


@pytest.fixture(scope="module")
def fleet(http, serve_cluster, ensure_app):
    ensure_app(BASE_ARGS, replicas=2, policy_replicas=2)
    return Fleet(http, serve_cluster[0])


def test_sessions_never_change_replica(fleet):
    first = fleet.round()
    assert all(r["restart_reason"] == "new_session" for r, _ in first.values())
    owners = {sid: replica for sid, (_, replica) in first.items()}
    assert len(set(owners.values())) == 2, "20 sessions should spread over both replicas"
    for _ in range(2):
        for sid, (report, replica) in fleet.round().items():
            assert replica == owners[sid] and report["restarted"] is False


def test_killed_replica_sessions_restart_and_no_client_hangs(fleet):
    import ray

    victim = sorted(set(fleet.replica.values()))[0]
    affected = {sid for sid, r in fleet.replica.items() if r == victim}

    def kill():
        time.sleep(0.2)  # let the round get in flight
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#Policy#{victim}", namespace="serve"), no_restart=True)

    start = len(fleet.log)
    fleet.round(during=kill)
    wait_replicas("Policy", 2, 120)  # Serve replaces the dead replica
    fleet.round()
    fleet.round()
    # every affected session's first answer from another replica says it restarted (its state died with the victim)
    first_elsewhere = {}
    for sid, report, replica in fleet.log[start:]:
        if sid in affected and replica != victim:
            first_elsewhere.setdefault(sid, report)
    assert set(first_elsewhere) == affected
    assert all(r["restarted"] for r in first_elsewhere.values()), first_elsewhere
    assert victim not in set(fleet.replica.values())
    assert all(not r["restarted"] for _, r, _ in fleet.log[-len(SESSIONS) :])  # settled again


def test_scaling_up_and_down_never_reuses_stale_state(fleet, serve_cluster):
    _, deploy = serve_cluster
    before = dict(fleet.replica)
    start = len(fleet.log)
    deploy(BASE_ARGS, wait_for=3, policy_replicas=3)  # config-only change: the two old replicas stay
    fleet.round()
    assert fleet.replica == before, "scaling up must move no live session (the session router keeps them)"
    assert not any(r["restart_reason"] == "new_session" for _, r, _ in fleet.log[start:])  # (window_full may)
    history = {sid: [r for s, _, r in fleet.log if s == sid] for sid in SESSIONS}  # replicas each session lived on
    deploy(BASE_ARGS, wait_for=2, policy_replicas=2)
    start = len(fleet.log)
    fleet.round()
    fleet.round()
    # Serve picks which replica to remove. Whichever it was, a session that changed replica must say it restarted,
    # and a session that came back to a replica holding an older state of it must say step_mismatch.
    changed = {}
    for sid, report, replica in fleet.log[start:]:
        if replica != history[sid][-1]:
            changed.setdefault(sid, (report, replica))
    for sid, (report, replica) in changed.items():
        assert report["restarted"], (sid, report)
        assert report["restart_reason"] in ("step_mismatch", "new_session", "evicted"), report
        if replica in history[sid][:-1]:  # back on a replica it left earlier: stale state is there
            assert report["restart_reason"] == "step_mismatch", (sid, report)
    assert all(r["restart_reason"] != "new_session" for _, r, _ in fleet.log[-len(SESSIONS) :])  # settled again
