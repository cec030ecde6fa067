"""Tenants on a real single-node Ray cluster: keys from a reloadable api_keys_file, every door (HTTP, the OpenPI
WebSocket, the ZeroMQ door) keeping tenants' sessions apart, quotas answering 429 + Retry-After while another
tenant's robot steps on, per-tenant metrics on Ray's Prometheus endpoint, and key rotation (the file, and a
`serve deploy` of the Ingress user_config) with the Policy replica and its live session untouched."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import zmq
from websockets.sync.client import connect

from dreamzero_client.wire import openpi, rldx
from tests.support.cluster import (
    APP,
    BASE_ARGS,
    DEPLOY_TIMEOUT_S,
    IMPORT_PATH,
    METRICS_URL,
    forget_deployed_app,
    wait_deployed,
)
from tests.support.host import free_port
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import decode, normalised_body
from tests.support.rldx import droid_rldx_observation

pytestmark = pytest.mark.cluster

GEN = "/v1/actions/generations"
MP = {"content-type": "application/msgpack"}
KEYS = {t: f"{t}-key-0" for t in ("team-a", "team-b", "eval", "farm", "burst")}
ZMQ_PORT = free_port()
QUOTAS = {"per_tenant": {
    "eval": {"max_sessions_per_replica": 2},
    "farm": {"max_sessions": 2},  # the total: counted through the ledger actor
    "burst": {"requests_per_s": 0.05, "burst": 2},
}}  # fmt: skip


def digest(key: str) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def write_keys(path, keys: dict[str, str]) -> None:
    path.write_text("".join(f"{t}: {digest(k)}\n" for t, k in keys.items()))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "api_keys.yaml"
    write_keys(path, KEYS)
    return path


def tenant_args(key_file) -> dict:
    return {**BASE_ARGS, "api_keys_file": str(key_file), "api_keys_reload_s": 1.0, "tenants": QUOTAS,
            "zmq": {"port": ZMQ_PORT, "host": "127.0.0.1"}}  # fmt: skip


@pytest.fixture
def app(serve_cluster, ensure_app, key_file, http):
    write_keys(key_file, KEYS)  # as the module started (a rotation test changes it)
    ensure_app(tenant_args(key_file))
    deadline = time.monotonic() + 60
    while post(http, serve_cluster[0], "team-b", ["ready"]).status_code != 200:  # until the file is read again
        assert time.monotonic() < deadline, "team-b's key is not accepted"
        time.sleep(0.5)
    return serve_cluster[0]


def post(http, base: str, tenant_or_key: str, ids: list[str], t: int = 1, **kwargs) -> httpx.Response:
    key = KEYS.get(tenant_or_key, tenant_or_key)
    body = normalised_body(ids, t=t, **kwargs)
    return http.post(base + GEN, content=body, headers={"Authorization": f"Bearer {key}", **MP})


class Robot:
    """One session of one tenant over HTTP, echoing its step and incarnation; records every report."""

    def __init__(self, http, base: str, tenant: str, sid: str):
        self.http, self.base, self.tenant, self.sid = http, base, tenant, sid
        self.key = KEYS[tenant]
        self.reports: list[tuple[dict, str]] = []

    def step(self) -> dict:
        last = self.reports[-1][0] if self.reports else None
        echo = {}
        if last is not None:
            echo = {"expected_steps": [last["step"]], "expected_incarnations": [last["incarnation"]]}
        resp = post(self.http, self.base, self.key, [self.sid], t=1 if last is None else 4, **echo)
        assert resp.status_code == 200, (self.tenant, resp.status_code, resp.content[:300])
        out = decode(resp.content)
        self.reports.append((out["sessions"][0], out["served_by"]))
        return out["sessions"][0]

    def continued(self, since: int = 1) -> bool:
        """Every chunk after the `since`-th continued the session on the same replica: no restart but the model's
        own at a full attention window."""
        own = [r for r, _ in self.reports[since:] if r["restarted"] and r["restart_reason"] != "window_full"]
        return not own and len({s for _, s in self.reports}) == 1


def policy_actor() -> tuple[str, int]:
    """(actor id, pid) of the one live Policy replica (as tests/cluster/test_node_loss.py reads them)."""
    import ray

    alive = [a for a in ray._private.state.actors(actor_state_name="ALIVE").values()
             if a["ActorClassName"] == f"ServeReplica:{APP}:Policy"]  # fmt: skip
    assert len(alive) == 1, alive
    return alive[0]["ActorID"], alive[0]["Pid"]


def ledger_counts() -> dict[str, int]:
    """The live sessions per tenant the application's ledger actor holds (reported by its Policy replicas)."""
    import ray

    try:
        ledger = ray.get_actor(f"dreamzero-tenant-ledger-{APP}", namespace="serve")
    except ValueError:  # not created yet: the first replica's first report creates it
        return {}
    return ray.get(ledger.report.remote("test-reader", {}), timeout=30)


# 1. Isolation on every door -------------------------------------------------------------------------------------------


def test_http_tenants_cannot_continue_or_reset_each_others_session(http, app):
    a, b = Robot(http, app, "team-a", "arm"), Robot(http, app, "team-b", "arm")
    a.step(), a.step()
    first_b = b.step()
    assert first_b["restart_reason"] == "new_session" and first_b["session_id"] == "arm"  # nothing of A's shows
    # team-b replays team-a's exact continuity fields, then resets "arm": only its own session is touched
    last_a = a.reports[-1][0]
    stolen = post(http, app, "team-b", ["arm"], t=4, expected_steps=[last_a["step"]],
                  expected_incarnations=[last_a["incarnation"]])  # fmt: skip
    assert decode(stolen.content)["sessions"][0]["restart_reason"] == "step_mismatch"
    reset = post(http, app, "team-b", ["arm"], t=4, reset_mask=[True])
    assert decode(reset.content)["sessions"][0]["restart_reason"] == "reset_requested"
    assert a.step()["step"] == 3 and a.continued()


def test_websocket_resume_token_is_bound_to_its_tenant(app):
    url = app.replace("http://", "ws://") + "/v1/realtime/robot/openpi"

    def ws(tenant: str, query: str):
        return connect(url + query, additional_headers={"Authorization": f"Api-Key {KEYS[tenant]}"}, open_timeout=30)

    def infer(sock, seed: int) -> dict:
        sock.send(openpi.pack_frame({**openpi_droid_observation(seed, "cam"), "response_format": "dict"}))
        return decode(sock.recv(timeout=120))["session"]

    with ws("team-a", "?handshake=extended") as sock:
        token = decode(sock.recv(timeout=60))["resume_token"]
        assert [infer(sock, s)["step"] for s in (0, 1)] == [1, 2]
    with ws("team-b", f"?resume={token}") as sock:
        decode(sock.recv(timeout=60))
        other = infer(sock, 2)
        assert other["step"] == 1 and other["restart_reason"] == "new_session"
    with ws("team-a", f"?resume={token}") as sock:
        decode(sock.recv(timeout=60))
        back = infer(sock, 3)
        assert back["step"] == 3 and not back["restarted"]


class Req:
    """A REQ socket with a chosen ZMQ identity (what lets a robot keep its sessions across reconnects)."""

    def __init__(self, identity: bytes, token: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.setsockopt(zmq.RCVTIMEO, 120_000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{ZMQ_PORT}")
        self.token = token

    def call(self, endpoint: str, data: dict | None = None):
        self.sock.send(rldx.pack({"endpoint": endpoint, "api_token": self.token, "data": data}))
        return rldx.unpack(self.sock.recv())

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def zmq_as(tenant: str, identity: bytes = b"robot-7") -> Req:
    # the door's ROUTER ignores a second peer with an identity it still holds: let the previous one's close land
    time.sleep(1.0)
    return Req(identity, KEYS.get(tenant, tenant))


def test_zmq_identity_of_another_tenant_reaches_nothing(app):
    obs = droid_rldx_observation(b=1)
    deadline = time.monotonic() + 120
    while True:  # the door binds when its replica starts, which /health does not wait for
        probe = zmq_as("team-a", b"probe")
        probe.sock.setsockopt(zmq.RCVTIMEO, 2000)
        try:
            if probe.call("ping").get("status") == "ok":
                break
        except zmq.Again:
            assert time.monotonic() < deadline, "the ZMQ door did not answer"
        finally:
            probe.close()
    a = zmq_as("team-a")
    try:
        _, info = a.call("get_action", {"observation": obs, "options": {"session_ids": ["arm"]}})
        first = info["sessions"][0]
    finally:
        a.close()
    b = zmq_as("team-b")  # the same identity, another tenant's token
    try:
        assert b.call("reset", {}) == {"cleared_sessions": []}  # team-a's session names are not listed
        _, info = b.call("get_action", {"observation": obs, "options": {"session_ids": ["arm"]}})
        assert info["sessions"][0]["restart_reason"] == "new_session"
        assert b.call("reset", {"options": {"session_ids": ["arm"]}}) == {"cleared_sessions": ["arm"]}
        denied = zmq_as("no-such-key", b"robot-8")
        assert denied.call("ping")["status"] == 401
        denied.close()
    finally:
        b.close()
    a = zmq_as("team-a")
    try:
        opts = {"session_ids": ["arm"], "expected_steps": [1], "expected_incarnations": [first["incarnation"]]}
        _, info = a.call("get_action", {"observation": obs, "options": opts})
        assert info["sessions"][0]["step"] == 2 and not info["sessions"][0]["restarted"]  # not reset by team-b
    finally:
        a.close()


# 2. Quotas, while another tenant's robot steps ------------------------------------------------------------------------


def test_quotas_refuse_their_tenant_while_another_robot_steps_on(http, app):
    robot = Robot(http, app, "team-a", "steady")
    robot.step()
    stop, errors = threading.Event(), []

    def keep_stepping():
        try:
            while not stop.is_set():
                robot.step()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=keep_stepping, daemon=True)
    thread.start()
    try:
        # sessions per replica: eval may hold 2
        assert [post(http, app, "eval", [f"e{i}"]).status_code for i in range(2)] == [200, 200]
        refused = post(http, app, "eval", ["e2"])
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 500  # its oldest idle: TTL 600
        err = decode(refused.content)["error"]
        assert err["code"] == "quota_exceeded" and "max_sessions_per_replica" in err["message"]
        assert "steady" not in err["message"] and "team-a" not in err["message"]
        assert post(http, app, "eval", ["e0"], t=4).status_code == 200  # its own sessions continue
        # sessions in total (the ledger's count): farm may hold 2 on all replicas together
        assert post(http, app, "farm", ["f0", "f1"]).status_code == 200
        refused = post(http, app, "farm", ["f2"])
        assert refused.status_code == 429 and "max_sessions" in decode(refused.content)["error"]["message"]
        # the replica reports about once a second, once the ledger actor has started (seconds under CI load)
        deadline = time.monotonic() + 60
        while ledger_counts().get("farm") != 2:
            assert time.monotonic() < deadline, ledger_counts()
            time.sleep(0.5)
        # requests per second: a burst of 2, then one every 20 s
        codes = [post(http, app, "burst", [f"b{i}"]).status_code for i in range(3)]
        assert codes == [200, 200, 429]
        refused = post(http, app, "burst", ["b3"])
        assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 20
        time.sleep(1.0)  # a few more of the robot's chunks after the refusals
    finally:
        stop.set()
        thread.join(timeout=180)
    assert not errors, errors
    assert len(robot.reports) >= 3 and robot.continued(), robot.reports


def test_per_tenant_metrics_reach_prometheus(http, app):
    assert post(http, app, "team-b", ["metrics"]).status_code == 200
    assert post(http, app, "wrong-key", ["metrics"]).status_code == 401
    assert 429 in [post(http, app, "burst", [f"m{i}"]).status_code for i in range(3)]  # a burst of 2 at most
    wanted = [
        'ray_dreamzero_tenant_requests_total{', 'tenant="team-b"', 'tenant="unauthenticated"',
        'ray_dreamzero_tenant_live_sessions{', 'ray_dreamzero_tenant_errors_total{', 'code="unauthorized"',
        'ray_dreamzero_tenant_quota_refusals_total{', 'quota="requests_per_s"', 'code="quota_exceeded"',
    ]  # fmt: skip
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        text = http.get(METRICS_URL["url"]).text
        if all(w in text for w in wanted):
            break
        time.sleep(1.0)
    assert all(w in text for w in wanted), [w for w in wanted if w not in text]
    for line in text.splitlines():  # a label holds a tenant, never a key or a session id
        if line.startswith("ray_dreamzero_tenant_"):
            assert not any(k in line for k in KEYS.values()) and '="metrics"' not in line and '="arm"' not in line


# 3. Rotation without a Policy restart ---------------------------------------------------------------------------------


def test_rotating_a_key_in_the_file_keeps_the_policy_and_the_session(http, app, key_file):
    robot = Robot(http, app, "team-b", "rotating")
    robot.step()
    before = policy_actor()
    write_keys(key_file, {**KEYS, "team-b": "team-b-key-1"})
    deadline = time.monotonic() + 30
    while post(http, app, KEYS["team-b"], ["probe"]).status_code != 401:
        assert time.monotonic() < deadline, "the old key of team-b is still accepted"
        time.sleep(0.5)
    robot.key = "team-b-key-1"
    robot.step(), robot.step()
    assert robot.continued() and [r["step"] for r, _ in robot.reports] == [1, 2, 3]
    assert policy_actor() == before


def test_rotating_keys_through_the_ingress_user_config(http, app, key_file):
    """What an operator does with `serve deploy`: a new Ingress `user_config` (args untouched), then none again: the
    Ingress is reconfigured in place both times, the Policy replica and a live session are untouched."""
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    def deploy_until(schema: dict, status: int, why: str) -> None:
        """Deploy `schema` and wait until team-c's key gets `status`."""
        started = time.time()
        serve.context._get_global_client().deploy_apps(ServeDeploySchema(applications=[schema]))
        wait_deployed(started, DEPLOY_TIMEOUT_S)
        deadline = time.monotonic() + 60
        while post(http, app, "team-c-key-0", ["c"]).status_code != status:
            assert time.monotonic() < deadline, why
            time.sleep(0.5)

    robot = Robot(http, app, "team-a", "live-config")
    robot.step()
    before = policy_actor()
    ingress = {"name": "Ingress", "user_config": {"api_keys": {"team-c": digest("team-c-key-0")}}}
    schema = {"name": APP, "route_prefix": "/", "import_path": IMPORT_PATH, "args": tenant_args(key_file),
              "deployments": [ingress]}  # fmt: skip
    try:
        deploy_until(schema, 200, "team-c's key did not take effect")
        robot.step()
        assert robot.continued() and policy_actor() == before
        assert decode(post(http, app, "team-c-key-0", ["c"], t=4).content)["sessions"][0]["step"] == 2
        # the operator removes the user_config again: the args keys come back in place (team-c's key is refused)
        deploy_until({**schema, "deployments": []}, 401, "team-c's key outlived the removed user_config")
        robot.step()
        assert robot.continued() and policy_actor() == before
    finally:
        forget_deployed_app()  # the next ensure_app deploys again
