"""A session that comes back to a replica holding its stale state *at the same step* must restart, never continue.

The session router never moves a live routing key (docs/serving.md, "How sessions are placed"), so scaling no
longer leaves such a copy behind. A client still can, by changing the routing key of a live session: here each
session runs two steps under its home key (replica A), two under a key held by the other replica (a restart there,
then step 2), and comes back under its home key. A's copy is at step 2 too, the step the client now expects; only
the incarnation tells them apart. Run through both HTTP forms (raw: preprocess builds the model batch).

Through the OpenPI WebSocket the routing key is the session's connection-scoped id (`ws-<connection>:<session>`), so
a socket always reaches the replica holding it; a client comes back to that key by resuming the connection (the
resume token of the extended handshake). The state can still be left behind there: the session steps twice on
replica A over a socket, continues under its namespaced id over HTTP on replica B (a restart, then step 2), and the
socket resumes echoing what it saw last (B's step 2 and incarnation). A's copy is at step 2 too; the incarnation in
the echo must restart it, flagged. A second resume with the right echo then continues (the control).
"""

from __future__ import annotations

import httpx
import pytest
from websockets.sync.client import connect as ws_connect

from deployments.routing import ws_session_id
from dreamzero_client.wire import codec, openpi
from tests.support.cluster import BASE_ARGS
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import decode, normalised_body, raw_body

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GEN = "/v1/actions/generations"
SESSIONS = 3
PROBES = 40  # new keys go to the least-loaded replica: enough to even out earlier tests' sessions
WS_PATH = "/v1/realtime/robot/openpi"
WS_TIMEOUT_S = 120


class Client:
    """Posts one session's step under a routing key, echoing the step and incarnation of its last reply."""

    def __init__(self, http: httpx.Client, base: str, form: str):
        self.http, self.url, self.form = http, base + GEN, form
        self.step: dict[str, int] = {}
        self.incarnation: dict[str, str] = {}

    def call(self, sid: str, key: str) -> tuple[dict, str]:
        expected = self.step.get(sid)
        build = raw_body if self.form == "raw" else normalised_body
        body = build(
            [sid],
            t=1 if expected is None else 4,
            expected_steps=None if expected is None else [expected],
            expected_incarnations=None if expected is None else [self.incarnation[sid]],
            routing_key=key,
        )
        resp = self.http.post(self.url, content=body, headers={"content-type": codec.content_type_for(codec.OPENPI)})
        assert resp.status_code == 200, (sid, resp.status_code, resp.content[:300])
        out = decode(resp.content)
        report = out["sessions"][0]
        self.step[sid], self.incarnation[sid] = report["step"], report["incarnation"]
        return report, out["served_by"]


def _keys_per_replica(client: Client, form: str) -> dict[str, str]:
    """A routing key held by each policy replica: a throwaway session per new key, until both replicas hold one."""
    held: dict[str, str] = {}
    for j in range(PROBES):
        key = f"{form}-probe-{j}"
        _, replica = client.call(key, key)
        held.setdefault(replica, key)
        if len(held) == 2:
            return held
    raise AssertionError(f"{PROBES} new keys all landed on {set(held)}: new sessions should spread")


@pytest.fixture(scope="module")
def cluster(http, serve_cluster, ensure_app):
    ensure_app(BASE_ARGS, replicas=2, policy_replicas=2)
    return http, serve_cluster[0]


@pytest.mark.parametrize("form", ["raw", "normalised"])
def test_stale_state_at_the_same_step_is_never_reused(cluster, form):
    client = Client(*cluster, form)
    held = _keys_per_replica(client, form)
    for i in range(SESSIONS):
        sid, home = f"{form}-stale-{i}", f"{form}-home-{i}"
        for _ in range(2):
            report, replica_a = client.call(sid, home)
        assert report["step"] == 2 and not report["restarted"], report
        away = next(key for replica, key in held.items() if replica != replica_a)
        first, replica_b = client.call(sid, away)
        assert replica_b != replica_a and first["restart_reason"] == "new_session", (first, replica_a, replica_b)
        second, _ = client.call(sid, away)
        assert second["step"] == 2 and not second["restarted"], second
        back, replica = client.call(sid, home)  # A still holds the home key and the stale state, at step 2
        assert replica == replica_a
        # continuing would say step 3, not restarted: the stale state of the earlier step 2 silently reused
        assert back["restarted"] is True and back["restart_reason"] == "step_mismatch", back
        assert back["step"] == 1


class Socket:
    """One OpenPI WebSocket connection asking for the extended handshake (the resume token), optionally resuming."""

    def __init__(self, base: str, resume: str | None = None):
        query = f"{openpi.QUERY_HANDSHAKE}=extended" + (f"&{openpi.QUERY_RESUME}={resume}" if resume else "")
        url = base.replace("http://", "ws://") + WS_PATH + "?" + query
        self.ws = ws_connect(url, open_timeout=30, close_timeout=5, max_size=None, compression=None)
        self.handshake, _ = openpi.unpack_frame(self.ws.recv(timeout=WS_TIMEOUT_S))
        self.token = self.handshake["resume_token"]
        self.calls = 0

    def infer(self, sid: str, echo: tuple[int, str] | None = None) -> tuple[dict, str]:
        """One infer in the dict form -> (session report, replica); `echo`: the client's own step and incarnation."""
        msg = {**openpi_droid_observation(self.calls, sid), "endpoint": "infer", "response_format": "dict"}
        if echo is not None:
            msg["expected_steps"], msg["expected_incarnations"] = [echo[0]], [echo[1]]
        self.calls += 1
        self.ws.send(openpi.pack_frame(msg))
        reply, _ = openpi.unpack_frame(self.ws.recv(timeout=WS_TIMEOUT_S))
        assert isinstance(reply, dict) and "session" in reply, reply
        return reply["session"], reply["served_by"]

    def close(self) -> None:
        self.ws.close()


def test_a_resumed_websocket_session_never_reuses_stale_state_at_the_same_step(cluster):
    http, base = cluster
    client = Client(http, base, "raw")
    held = _keys_per_replica(client, "ws")
    sid = "arm"
    socket = Socket(base)
    token = socket.token
    try:
        for _ in range(2):
            on_a, replica_a = socket.infer(sid)
    finally:
        socket.close()  # a resumable session stays on its replica (until the TTL) for the client to come back
    assert on_a["step"] == 2 and not on_a["restarted"], on_a

    model_id = ws_session_id(token, sid)  # the id the door gives the socket's session
    away = next(key for replica, key in held.items() if replica != replica_a)
    first, replica_b = client.call(model_id, away)
    assert replica_b != replica_a and first["restart_reason"] == "new_session", (first, replica_a, replica_b)
    on_b, _ = client.call(model_id, away)
    assert on_b["step"] == 2 and not on_b["restarted"] and on_b["incarnation"] != on_a["incarnation"], (on_a, on_b)

    socket = Socket(base, resume=token)
    try:
        assert socket.token == token
        back, replica = socket.infer(sid, echo=(on_b["step"], on_b["incarnation"]))
    finally:
        socket.close()
    assert replica == replica_a  # the socket's key still lives on A, with A's state at step 2
    # continuing would say step 3, not restarted: A's stale step 2 silently reused for the session B carried on
    assert back["restarted"] is True and back["restart_reason"] == "step_mismatch" and back["step"] == 1, back

    socket = Socket(base, resume=token)  # the control: the echo of the state A now holds continues it
    try:
        again, replica = socket.infer(sid, echo=(back["step"], back["incarnation"]))
    finally:
        socket.close()
    assert replica == replica_a
    assert (again["step"], again["restarted"], again["incarnation"]) == (2, False, back["incarnation"]), again
