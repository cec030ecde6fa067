"""HTTP routes on a real single-node Ray cluster: both request forms, every codec, auth, limits, health, metadata."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dreamzero_client.wire import codec
from tests.support.cluster import AUTH, METRICS_URL
from tests.support.request_builders import decode, normalised_body, raw_body

pytestmark = pytest.mark.cluster

GEN = "/v1/actions/generations"


def post(http, base, body: bytes, flavour: str = codec.OPENPI, headers: dict | None = None):
    hdrs = {"content-type": codec.content_type_for(flavour), "accept": codec.content_type_for(flavour), **AUTH}
    hdrs.update(headers or {})
    return http.post(base + GEN, content=body, headers=hdrs)


def test_health_models_metadata(http, front_door):
    assert http.get(front_door + "/health").status_code == 200
    assert http.get(front_door + "/healthz").json() == {"status": "ok"}
    models = http.get(front_door + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "dreamzero"
    meta = http.get(front_door + "/v1/actions/metadata", headers=AUTH).json()
    assert meta["action_horizon"] == 24 and meta["padded_action_dim"] == 32 and meta["action_dim"] == 8


def test_normalised_form_rlinf_style(http, front_door):
    # RLinf: msgpack both ways, reads data[0].action.values as the whole batch [B, H, 32]
    resp = post(http, front_door, normalised_body([f"rlinf-r0-stage0-slot{i}" for i in range(3)]))
    assert resp.status_code == 200, resp.text
    assert "msgpack" in resp.headers["content-type"]
    out = decode(resp.content)
    values = out["data"][0]["action"]["values"]
    assert values.dtype == np.float32 and values.shape == (3, 24, 32)
    assert out["form"] == "normalised" and len(out["sessions"]) == 3


@pytest.mark.parametrize("flavour", [codec.MSGPACK_NUMPY, codec.JSON])
def test_normalised_form_other_codecs(http, front_door, flavour):
    resp = post(http, front_door, normalised_body([f"codec-{flavour}"], flavour=flavour), flavour)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == codec.content_type_for(flavour)
    assert np.asarray(decode(resp.content, flavour)["data"][0]["action"]["values"]).shape == (1, 24, 32)


def test_raw_form_droid(http, front_door):
    resp = post(http, front_door, raw_body(["droid-raw"], response_format="raw"))
    assert resp.status_code == 200, resp.text
    out = decode(resp.content)
    assert out["form"] == "raw" and out["actions"].shape == (1, 24, 8)
    assert out["sessions"][0]["restart_reason"] == "new_session"
    assert {"decode", "preprocess", "policy", "postprocess"} <= set(out["timings"])


def test_large_raw_request_crosses_the_replicas(http, front_door):
    """A raw request over `preprocess.ingress_max_bytes` (3 robots x 4 frames x 3 cameras, ~6 MB; the front-door app
    sets 4 MiB) goes ingress -> Preprocess replica -> policy by reference, and a small one is transformed in the
    ingress; both answer, and the counter says where each ran."""
    body = raw_body([f"big-{i}" for i in range(3)], t=4)
    assert len(body) > 5 * 1024 * 1024
    resp = post(http, front_door, body)
    assert resp.status_code == 200, resp.text[:500]
    assert np.asarray(decode(resp.content)["data"][0]["action"]["values"]).shape == (3, 24, 8)
    assert post(http, front_door, raw_body(["small-raw"])).status_code == 200
    wait_for_metrics(
        http,
        "ray_dreamzero_raw_stage_runs_total{",
        'stage="preprocess"',
        'where="replicas"',
        'where="ingress"',
    )


def wait_for_metrics(http, *wanted: str, timeout_s: float = 60) -> None:
    """Until every string appears at Ray's Prometheus endpoint (metrics reach it within a few seconds)."""
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        text = http.get(METRICS_URL["url"]).text
        if all(w in text for w in wanted):
            return
        time.sleep(1.0)
    pytest.fail(f"missing from {METRICS_URL['url']}: {[w for w in wanted if w not in text]}")


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdC1rZXktMTIz"}],
    ids=["missing", "wrong", "scheme"],
)
def test_api_key_required(http, front_door, headers):
    hdrs = {"content-type": "application/msgpack", **headers}
    resp = http.post(front_door + GEN, content=normalised_body(["auth"]), headers=hdrs)
    assert resp.status_code == 401
    assert resp.headers["content-type"] == "application/msgpack"  # errors answer in the request's codec
    assert decode(resp.content)["error"]["code"] == "unauthorized"
    assert http.get(front_door + "/v1/models", headers=headers).status_code == 401


def test_api_key_header_variant(http, front_door):
    hdrs = {"Authorization": AUTH["Authorization"].replace("Bearer", "Api-Key")}
    assert http.get(front_door + "/v1/models", headers=hdrs).status_code == 200


def test_metrics_reach_rays_prometheus_endpoint(http, front_door):
    assert post(http, front_door, normalised_body(["metrics"])).status_code == 200
    wanted = (
        'ray_dreamzero_requests_total{', 'status="200"', "ray_dreamzero_stage_latency_ms_bucket",
        "ray_dreamzero_live_sessions{", "ray_dreamzero_batch_rows_count", 'deployment="Policy"',
    )  # fmt: skip
    wait_for_metrics(http, *wanted)
