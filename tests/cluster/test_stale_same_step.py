"""Scale-down returns sessions to replicas holding stale state *at the same step*: both server paths must notice.

Scaling the policy 2 -> 3 moves some sessions to the new replica (they restart there); two calls later they are at
step 2 there, and their old replica still holds their earlier state, also at step 2. Scaling back to 2 removes the
newest replica (Ray Serve stops the newest replica of a node first) and the hash ring sends those sessions back to
their old replica. The step the client expects matches the stale state's; only the incarnation tells them apart.
This runs the scenario through the raw HTTP form (preprocess builds the model batch) and through the OpenPI
WebSocket (the adapter remembers the step and incarnation per socket session); the normalised form is covered by
test_sessions_replicas.py.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from dreamzero_client.wire import codec
from tests.cluster.conftest import BASE_ARGS, HTTP_TIMEOUT_S
from tests.cluster.test_openpi_ws import connect, droid_frame, pack, recv
from tests.graph.helpers import decode, raw_body

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GEN = "/v1/actions/generations"
PROMPT = "pick up the cup"
#: sessions per transport: each moves to the new replica with probability ~1/3, so some always do
SESSIONS = 16
#: the sockets stay open, silent, while the policy scales (a deploy takes tens of seconds)
ARGS = {**BASE_ARGS, "http": {"ws_idle_timeout_s": 900.0}}
RETRIES = 20


class HttpSession:
    """A raw-form client that echoes the step and incarnation of its last reply, as the HTTP client does."""

    def __init__(self, client: httpx.AsyncClient, base: str, sid: str):
        self.client, self.url, self.sid = client, base + GEN, sid
        self.step: int | None = None
        self.incarnation: str | None = None

    async def call(self) -> tuple[dict, str]:
        for attempt in range(RETRIES):
            body = raw_body(
                [self.sid],
                t=1 if self.step is None else 4,
                expected_steps=None if self.step is None else [self.step],
                expected_incarnations=None if self.incarnation is None else [self.incarnation],
            )
            resp = await self.client.post(
                self.url, content=body, headers={"content-type": codec.content_type_for(codec.OPENPI)}
            )
            if resp.status_code == 503:  # the replica set is changing: retryable by contract
                await asyncio.sleep(0.5 + 0.1 * attempt)
                continue
            assert resp.status_code == 200, (self.sid, resp.status_code, resp.content[:300])
            out = decode(resp.content)
            report = out["sessions"][0]
            self.step, self.incarnation = report["step"], report["incarnation"]
            return report, out["served_by"]
        raise AssertionError(f"{self.sid}: still 503 after {RETRIES} retries")


class WsSession:
    """One OpenPI socket with one session; the server tracks its continuity, the client only sends frames."""

    def __init__(self, ws, sid: str):
        self.ws, self.sid, self.calls = ws, sid, 0

    async def call(self) -> tuple[dict, str]:
        for attempt in range(RETRIES):
            msg = {"session_id": self.sid, "prompt": PROMPT, "response_format": "dict", **droid_frame(seed=self.calls)}
            await self.ws.send(pack(msg))
            reply = await recv(self.ws)
            if reply.get("type") == "error" and reply.get("status") == 503:
                await asyncio.sleep(0.5 + 0.1 * attempt)
                continue
            assert "actions" in reply, (self.sid, reply)
            self.calls += 1
            return reply["session"], reply["served_by"]
        raise AssertionError(f"{self.sid}: still 503 after {RETRIES} retries")


async def _round(sessions) -> list[tuple[dict, str]]:
    return list(await asyncio.gather(*(s.call() for s in sessions)))


async def _scenario(base: str, deploy) -> dict[str, list]:
    """Run the scenario; returns, per transport, (first report after scale-down, replica) of each returning session."""
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, trust_env=False) as client:
        sockets = [await connect(base).__aenter__() for _ in range(SESSIONS)]
        try:
            for ws in sockets:
                await recv(ws)  # the handshake
            paths = {
                "http": [HttpSession(client, base, f"raw-stale-{i}") for i in range(SESSIONS)],
                "ws": [WsSession(ws, "robot") for ws in sockets],
            }
            everyone = paths["http"] + paths["ws"]
            for _ in range(2):  # step 1 and 2 on the two first replicas
                before = await _round(everyone)
            assert all(r["step"] == 2 and not r["restarted"] for r, _ in before), before

            await asyncio.to_thread(deploy, ARGS, 3, 3)  # config-only change: the two old replicas stay
            moved_reports = await _round(everyone)
            old_replicas = {rep for _, rep in before}
            new_replica = {rep for _, rep in moved_reports} - old_replicas
            assert len(new_replica) == 1, (old_replicas, moved_reports)
            moved = [i for i, (_, rep) in enumerate(moved_reports) if rep in new_replica]
            for i in moved:
                assert moved_reports[i][0]["restart_reason"] == "new_session", moved_reports[i]
            # the moved sessions reach step 2 on the new replica: the step their stale state has on the old one
            second = await _round([everyone[i] for i in moved])
            assert all(r["step"] == 2 and not r["restarted"] for r, _ in second), second

            await asyncio.to_thread(deploy, ARGS, 2, 2)
            after = await _round([everyone[i] for i in moved])
            returning: dict[str, list] = {"http": [], "ws": []}
            for i, (report, replica) in zip(moved, after):
                assert replica == before[i][1], "the newest replica should be the one removed (Ray Serve's rule)"
                returning["http" if i < SESSIONS else "ws"].append((report, replica))
            return returning
        finally:
            for ws in sockets:
                await ws.close()


@pytest.fixture(scope="module")
def returning(serve_cluster, ensure_app):
    base, deploy = serve_cluster
    ensure_app(ARGS, replicas=2, policy_replicas=2)
    try:
        return asyncio.run(_scenario(base, deploy))
    finally:
        deploy(ARGS, wait_for=2, policy_replicas=2)  # whatever happened, leave two replicas for the next test


@pytest.mark.parametrize("path", ["http", "ws"])
def test_stale_state_at_the_same_step_is_never_reused(returning, path):
    reports = returning[path]
    assert reports, f"no {path} session moved to the new replica ({SESSIONS} tried); the hash ring put none there"
    for report, _ in reports:
        # continuing would say step 3, not restarted: the stale state of the earlier step 2 silently reused
        assert report["restarted"] is True and report["restart_reason"] == "step_mismatch", report
        assert report["step"] == 1
