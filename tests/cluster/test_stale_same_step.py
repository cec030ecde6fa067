"""A session that comes back to a replica holding its stale state *at the same step* must restart, never continue.

The session router never moves a live routing key (docs/serving.md, "How sessions are placed"), so scaling no
longer leaves such a copy behind. A client still can, by changing the routing key of a live session: here each
session runs two steps under its home key (replica A), two under a key held by the other replica (a restart there,
then step 2), and comes back under its home key. A's copy is at step 2 too, the step the client now expects; only
the incarnation tells them apart. Run through both HTTP forms (raw: preprocess builds the model batch). An OpenPI
WebSocket session cannot do this: its key is its connection-scoped id, which the client does not choose.
"""

from __future__ import annotations

import httpx
import pytest

from dreamzero_client.wire import codec
from tests.cluster.conftest import BASE_ARGS
from tests.graph.helpers import decode, normalised_body, raw_body

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GEN = "/v1/actions/generations"
SESSIONS = 3
PROBES = 40  # new keys go to the least-loaded replica: enough to even out earlier tests' sessions


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
