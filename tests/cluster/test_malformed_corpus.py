"""A corpus of malformed requests and frames: each HTTP request gets the right 4xx and each WebSocket frame an error
frame with the right code (never a 500, an internal error or a traceback); the socket and the server keep serving.

Cases marked "fuzz" are crashes found while building the fuzzer (answered 500 before the fix); they stay as regressions.
"""
# Longer than ~400 lines on purpose: the corpus is one table of HTTP and WebSocket cases run against one cluster;
# split, it would start two.

from __future__ import annotations

import contextlib
import hashlib
import json

import msgpack
import numpy as np
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from deployments.requests import openpi as openpi_frames
from dreamzero_client.wire import codec, generations, openpi
from tests.support.cluster import API_KEY, AUTH, TENANT_KEYS
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import decode, droid_raw_observation, normalised_body, normalised_observation

pytestmark = pytest.mark.cluster

GEN = "/v1/actions/generations"
MP, JS = "application/msgpack", "application/json"


def _nd(dtype: str, shape: list, data: bytes) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def _normalised(**changes) -> dict:
    """A valid normalised body (as a decoded dict) with `changes` applied to observation / parameters / top level."""
    body = generations.build_request_body(normalised_observation(1), ["p"], ["corpus"])
    for path, value in changes.items():
        target = body
        *parents, leaf = path.split("__")
        for p in parents:
            target = target[p]
        if value is _DELETE:
            target.pop(leaf)
        else:
            target[leaf] = value
    return body


def _raw(**obs_changes) -> dict:
    obs = droid_raw_observation(1)
    for key, value in obs_changes.items():
        key = key.replace("__", ".")
        if value is _DELETE:
            obs.pop(key)
        else:
            obs[key] = value
    return generations.build_request_body(obs, ["pick"], ["corpus-raw"])


_DELETE = object()


def mp(obj) -> bytes:
    return codec.encode_msgpack(obj)


def raw_mp(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _with_obs(key: str, value) -> bytes:
    body = _normalised()
    body["input"]["observation"][key] = value
    return raw_mp({**body, "input": {**body["input"], "observation": {
        k: (v if isinstance(v, dict) else codec._openpi_default(v)) for k, v in body["input"]["observation"].items()
    }}})  # fmt: skip


def _nested(depth: int) -> dict:
    node: dict = {"k": 1}
    for _ in range(depth):
        node = {"k": node}
    return node


BIG = 9 * 1024 * 1024  # over the 8 MiB test limit
HUGE_ZERO_SHAPE = [0, 2**31 - 1, 2**31 - 1, 2**31 - 1]  # zero elements, yet past NumPy's size limit

# (id, body, content type, expected status, field expected in the error or None)
CORPUS = [
    # --- 400: the body cannot be decoded or has the wrong structure
    ("msgpack-garbage", b"\xc1\xc1\xc1", MP, 400, None),
    ("msgpack-empty", b"", MP, 400, None),
    ("msgpack-truncated", mp(_normalised())[:200], MP, 400, None),
    ("msgpack-trailing-bytes", mp(_normalised()) + b"\x00", MP, 400, None),
    ("msgpack-ext-type", raw_mp(msgpack.ExtType(42, b"x")), MP, 400, None),
    ("msgpack-top-level-list", raw_mp([1, 2, 3]), MP, 400, None),
    ("msgpack-int-map-key", raw_mp({1: "x"}), MP, 400, None),
    ("json-garbage", b"{not json", JS, 400, None),
    ("json-empty", b"", JS, 400, None),
    ("json-top-level-list", b"[1,2]", JS, 400, None),
    ("json-input-not-object", json.dumps({"input": 3}).encode(), JS, 400, None),
    ("json-parameters-not-object", json.dumps({"input": {}, "parameters": 3}).encode(), JS, 400, None),
    ("nd-object-dtype", _with_obs("state", _nd("|O", [1, 1, 64], b"\x00" * 512)), MP, 400, None),
    ("nd-complex-dtype", _with_obs("state", _nd("<c8", [1, 1, 64], b"\x00" * 512)), MP, 400, None),
    ("nd-void-dtype", _with_obs("state", _nd("|V8", [1, 1, 64], b"\x00" * 512)), MP, 400, None),
    ("nd-datetime-dtype", _with_obs("state", _nd("<M8[s]", [1, 1, 64], b"\x00" * 512)), MP, 400, None),
    ("nd-unknown-dtype", _with_obs("state", _nd("<q9", [1, 1, 64], b"\x00" * 512)), MP, 400, None),
    ("nd-bytes-mismatch", _with_obs("state", _nd("<f4", [1, 1, 64], b"\x00" * 10)), MP, 400, None),
    ("nd-negative-shape", _with_obs("state", _nd("<f4", [-1, 64], b"")), MP, 400, None),
    ("nd-missing-shape", _with_obs("state", {b"__ndarray__": True, b"data": b"", b"dtype": "<f4"}), MP, 400, None),
    (
        "msgpack-numpy-object-kind",
        _with_obs("state", {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1], b"data": b"\x00" * 8}),
        MP,
        400,
        None,
    ),
    ("json-5000-digit-int", b'{"input": ' + b"1" * 5000 + b"}", JS, 400, None),  # fuzz
    (
        "nd-zero-size-overflowing-shape",
        mp(_normalised(input__observation__state=_nd("<f4", HUGE_ZERO_SHAPE, b""))),
        MP,
        400,
        None,
    ),  # fuzz
    ("msgpack-nested-100-levels", raw_mp(_nested(100)), MP, 400, None),
    ("json-nested-100k-levels", b"[" * 100_000 + b"]" * 100_000, JS, 400, None),
    (
        "npgeneric-out-of-range",
        mp(_normalised(parameters__seed={b"__npgeneric__": True, b"data": 1000, b"dtype": "|i1"})),
        MP,
        400,
        None,
    ),
    ("complex-marker", mp(_normalised(parameters__seed={b"complex": True, b"data": b"1"})), MP, 400, None),
    ("msgpack-key-not-utf8", b"\x81\xc4\x02\xff\xfe\x01", MP, 400, None),
    ("msgpack-string-not-utf8", b"\x81\xa1a\xa2\xff\xfe", MP, 400, None),
    ("json-not-utf8", b'{"a": "\xff"}', JS, 400, None),
    # --- 415: neither msgpack nor JSON
    ("ctype-text", b"{}", "text/plain", 415, None),
    ("ctype-xml", b"<a/>", "application/xml", 415, None),
    ("ctype-png", b"\x89PNG", "image/png", 415, None),
    ("ctype-form", b"a=1", "application/x-www-form-urlencoded", 415, None),
    # --- 413: over the configured body limit
    ("body-too-large", b"\x00" * BIG, MP, 413, None),
    # --- 422: a field has a wrong value; the error names it
    ("no-session-ids", mp(_normalised(parameters__session_ids=_DELETE)), MP, 422, "parameters.session_ids"),
    ("empty-session-ids", mp(_normalised(parameters__session_ids=[])), MP, 422, "parameters.session_ids"),
    ("session-id-not-string", mp(_normalised(parameters__session_ids=[5])), MP, 422, "parameters.session_ids"),
    (
        "duplicate-session-ids",
        mp(generations.build_request_body(normalised_observation(2), ["p", "p"], ["d", "d"])),
        MP,
        422,
        "parameters.session_ids",
    ),
    ("reset-mask-length", mp(_normalised(parameters__reset_mask=[True, False])), MP, 422, "parameters.reset_mask"),
    ("reset-mask-not-bool", mp(_normalised(parameters__reset_mask=["yes"])), MP, 422, "parameters.reset_mask"),
    ("no-prompt", mp(_normalised(input__prompt=_DELETE)), MP, 422, "input.prompt"),
    ("prompt-count", mp(_normalised(input__prompt=["a", "b"])), MP, 422, "input.prompt"),
    ("prompt-not-string", mp(_normalised(input__prompt=[3])), MP, 422, "input.prompt"),
    ("observation-not-object", mp(_normalised(input__observation=[1])), MP, 422, "input.observation"),
    ("unknown-form", mp(_normalised(input__form="cooked")), MP, 422, "input.form"),
    ("unknown-response-format", mp(_normalised(runtime__response_format="xml")), MP, 422, "runtime.response_format"),
    ("unknown-output-format", mp(_normalised(runtime__output_format="torch")), MP, 422, "runtime.output_format"),
    ("negative-seed", mp(_normalised(parameters__seed=-1)), MP, 422, "parameters.seed"),
    ("string-seed", mp(_normalised(parameters__seed="1140")), MP, 422, "parameters.seed"),
    ("expected-steps-length", mp(_normalised(parameters__expected_steps=[1, 2])), MP, 422, "parameters.expected_steps"),
    ("empty-routing-key", mp(_normalised(parameters__routing_key="")), MP, 422, "parameters.routing_key"),
    ("model-not-string", mp(_normalised(model=7)), MP, 422, "model"),
    (
        "images-3-frames",
        mp(_normalised(input__observation__images=np.zeros((1, 3, 64, 128, 3), np.uint8))),
        MP,
        422,
        "input.observation.images",
    ),
    (
        "images-not-rgb",
        mp(_normalised(input__observation__images=np.zeros((1, 1, 64, 128, 4), np.uint8))),
        MP,
        422,
        "input.observation.images",
    ),
    (
        "state-wide",
        mp(_normalised(input__observation__state=np.zeros((1, 1, 65), np.float32))),
        MP,
        422,
        "input.observation.state",
    ),
    (
        "state-nan",
        mp(_normalised(input__observation__state=np.full((1, 1, 64), np.nan, np.float32))),
        MP,
        422,
        "input.observation.state",
    ),
    (
        "state-mask-floats",
        mp(_normalised(input__observation__state_mask=np.full((1, 1, 64), 0.5, np.float32))),
        MP,
        422,
        "input.observation.state_mask",
    ),
    (
        "normalised-with-raw-key",
        mp(_normalised(input__observation__foo=np.zeros((1, 3), np.float32))),
        MP,
        422,
        "input.observation.foo",
    ),
    (
        "observation-nested-too-deep",
        mp(_normalised(input__observation__a={"b": {"c": {"d": {"e": {"f": np.zeros((1,), np.float32)}}}}})),
        MP,
        422,
        "input.observation.a.b.c.d.e",
    ),
    ("session-id-too-long", mp(_normalised(parameters__session_ids=["x" * 300])), MP, 422, "parameters.session_ids"),
    (
        "incarnation-too-long",
        mp(_normalised(parameters__expected_incarnations=["x" * 100])),
        MP,
        422,
        "parameters.expected_incarnations[0]",
    ),
    ("seed-over-int63", mp(_normalised(parameters__seed=2**64 - 1)), MP, 422, "parameters.seed"),
    ("reset-mask-int", mp(_normalised(parameters__reset_mask=2)), MP, 422, "parameters.reset_mask"),
    (
        "images-strings",
        mp(_normalised(input__observation__images=np.full((1, 1, 2, 2, 3), "a"))),
        MP,
        422,
        "input.observation.images",
    ),
    (
        "json-state-nan",
        codec.encode_json(_normalised(input__observation__state=np.full((1, 1, 64), np.nan, np.float32))),
        JS,
        422,
        "input.observation.state",
    ),
    ("raw-missing-gripper", mp(_raw(state__gripper_position=_DELETE)), MP, 422, "state.gripper_position"),
    ("raw-joint-width", mp(_raw(state__joint_position=np.zeros((1, 6), np.float32))), MP, 422, "state.joint_position"),
    (
        "raw-float-image-range",
        mp(_raw(video__wrist_image_left=np.full((1, 1, 180, 320, 3), 7.0, np.float32))),
        MP,
        422,
        "video.wrist_image_left",
    ),
    (
        "raw-batch-mismatch",
        mp(_raw(state__joint_position=np.zeros((2, 7), np.float32))),
        MP,
        422,
        "input.observation.state.joint_position",
    ),
    (
        "raw-joint-nan",
        mp(_raw(state__joint_position=np.full((1, 7), np.nan, np.float32))),
        MP,
        422,
        "state.joint_position",
    ),
    ("raw-joint-strings", mp(_raw(state__joint_position=np.full((1, 7), "a"))), MP, 422, "state.joint_position"),
    (
        "raw-5-frames",
        mp(generations.build_request_body(droid_raw_observation(1, t=5), ["pick"], ["c5"])),
        MP,
        422,
        "images",
    ),
    (
        "raw-unknown-key",
        mp(_raw(state__cartesian_velocity=np.zeros((1, 6), np.float32))),
        MP,
        422,
        "state.cartesian_velocity",
    ),
]


def _frame(**changes) -> dict:
    """A valid OpenPI DROID infer frame with `changes` (None deletes a key)."""
    frame = {**openpi_droid_observation(0, "ws-corpus"), **changes}
    return {k: v for k, v in frame.items() if v is not None}


def _marker_frame(marker: dict) -> bytes:
    return raw_mp({"prompt": "p", "session_id": "ws-corpus", "observation/joint_position": marker})


IR, IO = "invalid_request", "invalid_observation"
# (id, frame, expected error code, field expected in the error frame or None)
WS_CORPUS = [
    ("text-frame", "hello", IR, None),
    ("garbage", b"\xc1\xc1", IR, None),
    ("empty", b"", IR, None),
    ("top-level-list", raw_mp([1, 2]), IR, None),
    ("int-map-key", raw_mp({1: 2}), IR, None),
    ("ext-type", raw_mp(msgpack.ExtType(5, b"x")), IR, None),
    ("truncated", mp(_frame())[:300], IR, None),
    ("object-dtype", _marker_frame(_nd("|O", [1], b"\x00" * 8)), IR, None),
    ("bytes-mismatch", _marker_frame(_nd("<f4", [7], b"\x00" * 3)), IR, None),
    ("zero-size-overflowing-shape", _marker_frame(_nd("<f4", HUGE_ZERO_SHAPE, b"")), IR, None),  # fuzz
    ("unknown-endpoint", mp(_frame(endpoint="explode")), IO, "endpoint"),
    ("session-id-int", mp(_frame(session_id=5)), IO, "session_id"),
    ("session-id-empty", mp(_frame(session_id="")), IO, "session_id"),
    ("session-id-too-long", mp(_frame(session_id="x" * 300)), IO, "session_id"),
    ("reset-session-id-int", mp({"endpoint": "reset", "session_id": 3}), IO, "session_id"),
    ("prompt-int", mp(_frame(prompt=3)), IO, "prompt"),
    ("no-prompt", mp(_frame(prompt=None)), IO, "prompt"),
    ("seed-negative", mp(_frame(seed=-1)), IO, "seed"),
    ("seed-string", mp(_frame(seed="1")), IO, "seed"),
    ("response-format", mp(_frame(response_format="xml")), IO, "response_format"),
    ("bad-key", mp(_frame(**{"observation/bad key": np.zeros(3)})), IO, "observation/bad key"),
    ("no-cameras", mp({"prompt": "p", "session_id": "s", "observation/joint_position": np.zeros(7)}), IO, None),
    ("joint-width", mp(_frame(**{"observation/joint_position": np.zeros(6, np.float32)})), IO, "state.joint_position"),
    (
        "joint-nan",
        mp(_frame(**{"observation/joint_position": np.full(7, np.nan, np.float32)})),
        IO,
        "state.joint_position",
    ),
    (
        "image-float-range",
        mp(_frame(**{"observation/wrist_image_left": np.full((180, 320, 3), 7.0, np.float32)})),
        IO,
        "video.wrist_image_left",
    ),
    (
        "image-gray",
        mp(_frame(**{"observation/wrist_image_left": np.zeros((180, 320), np.uint8)})),
        IO,
        "observation/wrist_image_left",
    ),
    (
        "image-strings",
        mp(_frame(**{"observation/wrist_image_left": np.full((180, 320, 3), "a")})),
        IO,
        "video.wrist_image_left",
    ),
    (
        "gripper-ragged",
        mp(_frame(**{"observation/gripper_position": [[1, 2], [3]]})),
        IO,
        "observation/gripper_position",
    ),
]


def test_corpus_is_big_enough():
    assert len(CORPUS) + len(WS_CORPUS) >= 60
    for corpus in (CORPUS, WS_CORPUS):
        assert len({c[0] for c in corpus}) == len(corpus)


@pytest.mark.parametrize("name, body, ctype, status, field", CORPUS, ids=[c[0] for c in CORPUS])
def test_malformed_request(http, front_door, name, body, ctype, status, field):
    resp = http.post(front_door + GEN, content=body, headers={"content-type": ctype, **AUTH})
    assert resp.status_code == status, (name, resp.status_code, resp.content[:300])
    err = decode(resp.content, codec.OPENPI if "msgpack" in resp.headers["content-type"] else codec.JSON)
    assert err["error"]["message"] and _no_traceback(err["error"]["message"])
    if field is not None:
        assert err["error"]["field"] == field, err


def test_server_still_serves_after_the_corpus(http, front_door):
    body = normalised_body(["after-corpus"])
    resp = http.post(front_door + GEN, content=body, headers={"content-type": MP, **AUTH})
    assert resp.status_code == 200
    assert http.get(front_door + "/health").status_code == 200


def _ws(front_door: str):
    url = front_door.replace("http://", "ws://") + "/v1/realtime/robot/openpi"
    return connect(url, additional_headers={"Authorization": f"Api-Key {API_KEY}"}, max_size=None, open_timeout=30)


def _no_traceback(text: str) -> bool:
    return "Traceback" not in text and 'File "' not in text


@pytest.mark.parametrize("name, frame, code, field", WS_CORPUS, ids=[c[0] for c in WS_CORPUS])
def test_malformed_frame(front_door, name, frame, code, field):
    """An error frame with the right code, then the same socket still answers (a reset needs no inference)."""
    with _ws(front_door) as ws:
        assert "image_resolution" in decode(ws.recv(timeout=60))
        ws.send(frame)
        err = decode(ws.recv(timeout=120))
        assert openpi.is_error_frame(err), (name, err)
        assert err["code"] == code and err["message"] and _no_traceback(err["message"]), (name, err)
        if field is not None:
            assert err["field"] == field, (name, err)
        ws.send(mp({"endpoint": "reset", "session_id": "after-error"}))
        assert decode(ws.recv(timeout=60)) == openpi_frames.OPENPI_RESET_REPLY


def test_websocket_still_infers_after_the_corpus(front_door, http):
    with _ws(front_door) as ws:
        decode(ws.recv(timeout=60))
        ws.send(mp({**openpi_droid_observation(1, "after-ws-corpus"), "response_format": "dict"}))
        reply = decode(ws.recv(timeout=180))
        assert reply["actions"].shape == (24, 8) and reply["session"]["step"] == 1, reply
    assert http.get(front_door + "/health").status_code == 200


# --- Tenants (docs/serving.md, "Tenants and TLS"): a wrong key, and the key of another tenant ------------------------
NO_KEY = "missing or wrong API key; send 'Authorization: Bearer <key>' or 'Api-Key <key>'"
A_KEY, B_KEY = TENANT_KEYS["team-a"], TENANT_KEYS["team-b"]
# (id, Authorization header or None): each gets exactly the 401 below, whatever the key resembles
KEY_CORPUS = [
    ("no-key", None),
    ("scheme-without-key", "Bearer"),
    ("wrong-key", "Bearer not-a-key"),
    ("unknown-tenant-key", "Api-Key team-c-key-000"),
    ("digest-sent-as-key", "Bearer sha256:" + hashlib.sha256(A_KEY.encode()).hexdigest()),
    ("tenant-name-sent-as-key", "Bearer team-a"),
    ("key-with-a-suffix", f"Bearer {A_KEY}x"),
    ("key-prefix", f"Bearer {A_KEY[:-1]}"),
    ("basic-scheme", f"Basic {A_KEY}"),
    ("bare-key", A_KEY),
]


@pytest.mark.parametrize("name, authorization", KEY_CORPUS, ids=[c[0] for c in KEY_CORPUS])
def test_wrong_key_gets_exactly_401(http, front_door, name, authorization):
    headers = {"content-type": JS} | ({} if authorization is None else {"Authorization": authorization})
    resp = http.post(front_door + GEN, content=normalised_body(["key-corpus"], flavour=codec.JSON), headers=headers)
    assert resp.status_code == 401 and "retry-after" not in resp.headers, (name, resp.status_code)
    assert resp.json() == {"error": {"code": "unauthorized", "message": NO_KEY}, "detail": NO_KEY}


#: the reply echo every row's report carries (docs/fleet.md): this request's own times and class, not the session's
ECHO = ("observed_at", "observed_at_source", "server_ms", "traffic_class")


def _session(report: dict) -> dict:
    """A row's report without its reply echo: what it says of the session; the echo is checked to be the request's."""
    assert report["observed_at_source"] == "server" and report["traffic_class"] == "realtime", report
    return {k: v for k, v in report.items() if k not in ECHO}


def _report(http, base: str, key: str, sid: str, t: int = 1, **params) -> dict:
    body = normalised_body([sid], t=t, flavour=codec.JSON, **params)
    resp = http.post(base + GEN, content=body, headers={"content-type": JS, "Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.content[:300]
    return resp.json()["sessions"][0]


def test_key_of_another_tenant_reaches_only_its_own_session(http, front_door):
    """team-b sends team-a's session id with team-a's exact continuity fields, then resets it: it gets (and resets)
    a session of its own, told exactly what a first call is told; team-a's session goes on untouched."""
    sid = "tenant-corpus"
    a1 = _report(http, front_door, A_KEY, sid)
    echo = {"expected_steps": [a1["step"]], "expected_incarnations": [a1["incarnation"]]}
    b1 = _report(http, front_door, B_KEY, sid, **echo)
    assert b1["incarnation"] != a1["incarnation"]
    assert _session(b1) == {"session_id": sid, "step": 1, "restarted": True, "restart_reason": "new_session",
                  "frame_position": a1["frame_position"], "incarnation": b1["incarnation"]}  # fmt: skip
    b2 = _report(http, front_door, B_KEY, sid, t=4, reset_mask=[True])
    assert (b2["step"], b2["restart_reason"]) == (1, "reset_requested")
    legacy = _report(http, front_door, API_KEY, sid, **echo)  # the legacy key is the tenant `default`: a third one
    assert (legacy["step"], legacy["restart_reason"]) == (1, "new_session")
    a2 = _report(http, front_door, A_KEY, sid, t=4, **echo)
    assert (a2["step"], a2["restarted"], a2["incarnation"]) == (2, False, a1["incarnation"])


def test_websocket_wrong_key_and_another_tenants_resume_token(front_door):
    url = front_door.replace("http://", "ws://") + "/v1/realtime/robot/openpi"
    with pytest.raises(InvalidStatus) as info:  # refused at the handshake, before any frame
        connect(url, additional_headers={"Authorization": "Api-Key not-a-key"}, open_timeout=30)
    assert info.value.response.status_code == 403

    def infer(ws, seed: int) -> dict:
        ws.send(mp({**openpi_droid_observation(seed, "cam"), "response_format": "dict"}))
        return decode(ws.recv(timeout=120))["session"]

    @contextlib.contextmanager
    def open_as(key: str, query: str):
        with connect(url + query, additional_headers={"Authorization": f"Api-Key {key}"}, open_timeout=30) as ws:
            decode(ws.recv(timeout=60))
            yield ws

    with connect(url + "?handshake=extended", additional_headers={"Authorization": f"Api-Key {A_KEY}"},
                 open_timeout=30) as ws:  # fmt: skip
        token = decode(ws.recv(timeout=60))["resume_token"]
        first = infer(ws, 0)
    with open_as(B_KEY, f"?resume={token}") as ws:
        other = infer(ws, 1)
    # a first call's report, of its own session
    assert _session(other) == {**_session(first), "incarnation": other["incarnation"]}
    with open_as(A_KEY, f"?resume={token}") as ws:
        back = infer(ws, 2)
    assert (back["step"], back["restarted"], back["incarnation"]) == (2, False, first["incarnation"])
