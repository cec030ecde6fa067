"""The HTTP and WebSocket front door under abuse (issue 45), in-process (Starlette's TestClient, no Ray): bomb
bodies refused naming the decode limit, connection caps per tenant (or client address), bodies that arrive too
slowly, an idle timeout that junk frames do not reset, short error replies, and the legacy key hashed as read."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import time
from types import SimpleNamespace

import msgpack
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from deployments.auth import ConnectionSlots, caller_of
from deployments.ingress import IngressDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from deployments.tenants import TenantKeys
from dreamzero.errors import QuotaExceeded, RequestTimeout
from dreamzero_client.wire import codec, openpi
from serve_graph.builder import ingress_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.ingress import FakePolicy
from tests.support.request_builders import LocalHandle, decode

KEYS = {"team-a": "key-a-123", "team-b": "key-b-456"}
GEN = "/v1/actions/generations"
MSGPACK = {"content-type": codec.MSGPACK_CONTENT_TYPE}


def _auth(tenant: str, scheme: str = "Bearer") -> dict:
    return {"Authorization": f"{scheme} {KEYS[tenant]}"}


def _door(args: dict) -> SimpleNamespace:
    stages = (PreprocessDeployment(), FakePolicy(), PostprocessDeployment())
    cfg = parse_app_args(args)
    ingress = IngressDeployment(*[LocalHandle(s) for s in stages], ingress_settings(cfg, resolve_model(cfg)))
    return ingress


@pytest.fixture
def door():
    args = {
        "api_keys": {t: "sha256:" + hashlib.sha256(k.encode()).hexdigest() for t, k in KEYS.items()},
        "http": {"max_body_bytes": 8 * 1024 * 1024, "ws_idle_timeout_s": 1.0, "ws_max_per_tenant": 2},
    }
    ingress = _door(args)
    with TestClient(ingress.__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
        yield SimpleNamespace(client=client, ingress=ingress)


def _list_tree(leaf: bytes, fan: int, levels: int) -> bytes:
    node = b"\xdc" + fan.to_bytes(2, "big") + leaf * fan
    for _ in range(levels):
        node = b"\xdc" + fan.to_bytes(2, "big") + node * fan
    return b"\x81\xa5input" + node


@pytest.mark.parametrize(
    "body, ctype",
    [
        (_list_tree(b"\x90", 180, 2), codec.MSGPACK_CONTENT_TYPE),  # 5.8 M empty lists, 5.6 MiB
        (b'{"input":[' + b"{}," * 2_000_000 + b"{}]}", codec.JSON_CONTENT_TYPE),
        (b'{"input":' + b"[" * 65 + b"]" * 65 + b"}", codec.JSON_CONTENT_TYPE),
    ],
    ids=[
        "msgpack-lists",
        "json-maps",
        "json-deep",
    ],  # every kind at every size: tests/unit/deployments/test_decode_limits.py
)
def test_bomb_bodies_are_a_400_naming_the_limit(door, body, ctype):
    resp = door.client.post(GEN, content=body, headers={**_auth("team-a"), "content-type": ctype})
    assert resp.status_code == 400, resp.content[:200]
    error = decode(resp.content)["error"] if "msgpack" in ctype else resp.json()["error"]
    assert any(limit in error["message"] for limit in ("max_objects", "max_depth")), error


def test_bomb_frames_to_the_websocket_are_an_error_frame_naming_the_limit(door):
    with door.client.websocket_connect("/", headers=_auth("team-a", "Api-Key")) as ws:
        openpi.unpack_frame(ws.receive_bytes())  # the handshake
        ws.send_bytes(_list_tree(b"\x90", 180, 2))
        frame, _ = openpi.unpack_frame(ws.receive_bytes())
        assert frame["type"] == "error" and frame["status"] == 400 and "max_objects" in frame["message"]


def test_an_error_reply_quotes_a_long_shape_briefly(door):
    shape = list(range(4000))
    body = {"input": {"prompt": ["x"], "observation": {"images": {"__ndarray__": True, "data": b"", "dtype": "|u1",
            "shape": shape}}}, "parameters": {"session_ids": ["s"]}}  # fmt: skip
    packed = msgpack.packb(body, use_bin_type=True)
    resp = door.client.post(GEN, content=packed, headers={**_auth("team-a"), **MSGPACK})
    assert resp.status_code == 400 and len(resp.content) < 1024
    assert "4000 items" in decode(resp.content)["error"]["message"]


def test_one_tenant_at_its_websocket_cap_leaves_the_others_and_healthz(door):
    a1 = door.client.websocket_connect("/", headers=_auth("team-a", "Api-Key"))
    a2 = door.client.websocket_connect("/", headers=_auth("team-a", "Api-Key"))
    with a1 as w1, a2 as w2:
        for w in (w1, w2):
            openpi.unpack_frame(w.receive_bytes())
        with door.client.websocket_connect("/", headers=_auth("team-a", "Api-Key")) as w3:
            frame, _ = openpi.unpack_frame(w3.receive_bytes())
            assert frame["status"] == 429 and "http.ws_max_per_tenant" in frame["message"]
            with pytest.raises(WebSocketDisconnect) as closed:
                w3.receive_bytes()
            assert closed.value.code == 1013  # try again later
        with door.client.websocket_connect("/", headers=_auth("team-b", "Api-Key")) as wb:
            assert "action_space" in openpi.unpack_frame(wb.receive_bytes())[0]  # another tenant's handshake
        assert door.client.get("/healthz").status_code == 200
    # closed sockets give their slots back
    with door.client.websocket_connect("/", headers=_auth("team-a", "Api-Key")) as w4:
        assert "action_space" in openpi.unpack_frame(w4.receive_bytes())[0]


def test_junk_frames_do_not_keep_a_websocket_open(door):
    with door.client.websocket_connect("/", headers=_auth("team-a", "Api-Key")) as ws:
        openpi.unpack_frame(ws.receive_bytes())
        deadline = time.monotonic() + 20  # a bound for the test only: the door closes it at its 1 s idle timeout
        with pytest.raises(WebSocketDisconnect) as closed:
            while time.monotonic() < deadline:
                ws.send_bytes(b"\xc1")  # never valid msgpack: answered with an error frame
                frame, _ = openpi.unpack_frame(ws.receive_bytes())
                assert frame["type"] == "error"
                time.sleep(0.2)
        assert closed.value.code == 1000


def test_connection_slots_per_caller_and_in_all():
    slots = ConnectionSlots("open WebSockets", 2, "ws_max_per_tenant", 3, "ws_max_total")
    slots.acquire("tenant:a")
    slots.acquire("tenant:a")
    with pytest.raises(QuotaExceeded, match="http.ws_max_per_tenant") as err:
        slots.acquire("tenant:a")
    assert err.value.quota == "ws_max_per_tenant"
    slots.acquire("tenant:b")
    with pytest.raises(QuotaExceeded, match="http.ws_max_total"):
        slots.acquire("tenant:c")
    slots.release("tenant:a")
    with slots.hold("tenant:c"):
        assert slots.held == {"tenant:a": 1, "tenant:b": 1, "tenant:c": 1}
    assert slots.count == 2 and "tenant:c" not in slots.held


def test_without_keys_the_caps_count_client_addresses():
    assert caller_of(TenantKeys({}), "default", "10.0.0.7") == "address:10.0.0.7"
    keyed = TenantKeys({"team-a": ("sha256:" + "0" * 64,)})
    assert caller_of(keyed, "team-a", "10.0.0.7") == "tenant:team-a"


def _trickle_request(chunks_and_waits, **state):
    async def stream():
        for chunk, wait in chunks_and_waits:
            await asyncio.sleep(wait)
            yield chunk

    return SimpleNamespace(headers={}, stream=stream, state=SimpleNamespace(**state), client=None)


def test_a_body_below_the_minimum_rate_is_a_408_naming_it():
    ingress = _door({"http": {"body_min_bytes_per_s": 1000, "body_grace_s": 0.2, "body_timeout_s": 30}})
    slow = _trickle_request([(b"{", 0.0), (b" ", 0.5), (b"}", 0.0)])
    with pytest.raises(RequestTimeout, match="http.body_min_bytes_per_s"):
        asyncio.run(ingress.http.read_body(slow))
    fast = _trickle_request([(b'{"a":', 0.0), (b"1}", 0.05)])
    assert asyncio.run(ingress.http.read_body(fast)) == b'{"a":1}'
    assert ingress.http.body_reads.count == 0  # both gave their slot back


def test_slow_bodies_are_capped_per_caller_fast_ones_never_counted():
    ingress = _door({"http": {"body_reads_per_tenant": 1, "body_min_bytes_per_s": 0}})
    slow = [(b"{", 0.0), (b"}", 2.5)]  # still arriving past SLOW_BODY_S: it holds the caller's one slot

    async def three():
        first = asyncio.ensure_future(ingress.http.read_body(_trickle_request(slow)))
        await asyncio.sleep(0.1)
        fast = await ingress.http.read_body(_trickle_request([(b"{", 0.0), (b"}", 0.2)]))
        with pytest.raises(QuotaExceeded, match="http.body_reads_per_tenant"):
            await ingress.http.read_body(_trickle_request([(b"{", 0.0), (b"}", 2.0)]))
        return fast, await first

    assert asyncio.run(three()) == (b"{}", b"{}")  # the slow body arrives whole: waiting never cut its stream
    assert ingress.http.body_reads.count == 0


def test_connection_caps_must_leave_slots():
    set_cap = {"ingress": {"max_ongoing_requests": 8}, "http": {"ws_max_per_tenant": 8}}
    with pytest.raises(Exception, match="http.ws_max_per_tenant is 8 but ingress.max_ongoing_requests is 8"):
        parse_app_args(set_cap)
    small = parse_app_args({"ingress": {"max_ongoing_requests": 8}}).http  # defaults follow a smaller Ingress
    assert (small.ws_max_per_tenant, small.body_reads_per_tenant, small.ws_max_total) == (4, 4, 4)
    assert parse_app_args({}).http.ws_max_total == 32  # half of the 64 slots
    assert parse_app_args({"ingress": {"max_ongoing_requests": 16}}).http.ws_max_total == 8


def test_the_legacy_key_is_hashed_as_it_is_read():
    secret = "legacy-secret-7f3a"
    cfg = parse_app_args({"api_key": secret})
    digest = "sha256:" + hashlib.sha256(secret.encode()).hexdigest()
    assert cfg.api_key == cfg.api_key_digest == digest
    settings = ingress_settings(cfg, resolve_model(cfg))
    for text in (repr(cfg), cfg.model_dump_json(), repr(settings), pickle.dumps(settings)):
        assert (secret.encode() if isinstance(text, bytes) else secret) not in text
    assert parse_app_args({"api_key": digest}).api_key_digest == digest  # the digest itself is accepted
    with pytest.raises(Exception, match="api_key"):
        parse_app_args({"api_key": "sha256:abc"})


def test_every_error_reply_is_cut_short():
    from deployments.error_replies import MAX_MESSAGE_CHARS, classify
    from dreamzero.errors import InvalidObservation

    reply = classify(InvalidObservation("shape " + "[1, 2, 3] " * 1_000_000, field="x" * 10_000))
    assert len(reply.message) <= MAX_MESSAGE_CHARS and "more characters" in reply.message
    assert len(reply.field) <= 256
