"""The clients over TLS (dreamzero_client.tls): https:// and wss:// verified against a CA bundle, and the TLS cases of
the malformed-request corpus: a certificate the client cannot trust (no CA bundle, another CA), one for another host
name, an expired one, and a port that does not speak TLS, each refused at once with its exact `SecureChannelError`
and never retried, never answered in plain text. The servers are uvicorn with `ssl_certfile` / `ssl_keyfile`, as
Serve's proxy runs it (tests/e2e/test_tls_serve.py does the same through a real `serve run`; the `pki` and
`tls_servers` fixtures: tests/unit/conftest.py). Robot client only: the DROID links and the command lines over TLS
are in tests/unit/droid_runtime/test_tls_links.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dreamzero_client.errors import ConfigError, SecureChannelError
from dreamzero_client.http_client import ActionClient
from dreamzero_client.openpi_client import OpenPIClient
from tests.support.tls import HANDSHAKE

#: a retry or a reconnect would sleep this long first: a refusal must come well before it
BACKOFF_S = 30.0


def test_https_and_wss_round_trips_verified_by_the_ca_bundle(pki, tls_servers):
    port = tls_servers["good"]
    with ActionClient(f"https://localhost:{port}", ca_bundle=pki.ca, timeout_s=10) as client:
        assert client.health() == {"status": "ok", "scheme": "https"}
        assert client.wait_until_ready(timeout_s=10)["scheme"] == "https"
    with OpenPIClient(f"wss://localhost:{port}/ws", ca_bundle=str(pki.ca), timeout_s=10) as ws:
        assert ws.get_server_metadata() == HANDSHAKE
        out = ws.infer({"step": 3})
        assert out["scheme"] == "wss" and out["actions"].shape == (2, 8) and float(out["actions"][0, 0]) == 3.0


UNTRUSTED = "unable to get local issuer certificate"
REFUSALS = {  # case -> (server, ca bundle, OpenSSL's reason, what the message tells the user to do)
    "no_ca_bundle": ("good", None, UNTRUSTED, "pass the CA certificate that signed it (ca_bundle / --ca-bundle)"),
    "another_ca": ("good", "other_ca", UNTRUSTED, "pass the CA certificate that signed it (ca_bundle / --ca-bundle)"),
    "other_host_name": (
        "other_host",
        "ca",
        "Hostname mismatch, certificate is not valid for 'localhost'",
        "connect by a name the certificate carries (its subjectAltName) or reissue it for this host",
    ),
    "expired": ("expired", "ca", "certificate has expired", "the server's certificate must be renewed"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
@pytest.mark.parametrize("transport", ["https", "wss"])
def test_a_certificate_that_does_not_verify_is_refused_at_once(pki, tls_servers, case, transport):
    server, bundle, reason, hint = REFUSALS[case]
    ca_bundle = getattr(pki, bundle) if bundle else None
    url = f"{transport}://localhost:{tls_servers[server]}"
    expected = f"TLS: the certificate of {url} did not verify: {reason}; {hint}"
    t0 = time.monotonic()
    with pytest.raises(SecureChannelError) as refused:
        if transport == "https":
            with ActionClient(url, ca_bundle=ca_bundle, timeout_s=10, max_retries=3, backoff_s=BACKOFF_S) as client:
                client.wait_until_ready(timeout_s=120, poll_interval_s=BACKOFF_S)
        else:
            OpenPIClient(url, ca_bundle=ca_bundle, timeout_s=10, max_reconnects=3, reconnect_backoff_s=BACKOFF_S)
    assert str(refused.value) == expected
    assert refused.value.reason == reason
    assert isinstance(refused.value, ConnectionError)  # a policy loop files it as server_unreachable
    assert time.monotonic() - t0 < BACKOFF_S / 2, "refused only after a retry"


def test_generate_is_refused_without_retries(pki, tls_servers):
    url = f"https://localhost:{tls_servers['expired']}"
    with ActionClient(url, ca_bundle=pki.ca, max_retries=3, backoff_s=BACKOFF_S) as c:
        t0 = time.monotonic()
        with pytest.raises(SecureChannelError, match="certificate has expired"):
            c.generate({"state.x": np.zeros((1, 1), np.float32)}, "p", "s")
        assert time.monotonic() - t0 < BACKOFF_S / 2


@pytest.mark.parametrize("transport", ["https", "wss"])
def test_a_port_without_tls_is_a_failed_handshake_not_plain_text(pki, tls_servers, transport):
    url = f"{transport}://localhost:{tls_servers['plain']}"
    with pytest.raises(SecureChannelError) as refused:
        if transport == "https":
            ActionClient(url, ca_bundle=pki.ca, timeout_s=10, max_retries=0).health()
        else:
            OpenPIClient(url, ca_bundle=pki.ca, timeout_s=10, max_reconnects=0)
    reason = refused.value.reason
    assert str(refused.value) == f"TLS: the handshake with {url} failed: {reason} (does that port serve TLS?)"
    assert refused.value.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG")


def test_ca_bundle_errors_name_the_field(pki, tmp_path):
    with pytest.raises(ConfigError, match=r"^base_url: a CA bundle was given for a http:// URL, which is not encr"):
        ActionClient("http://localhost:1", ca_bundle=pki.ca)
    with pytest.raises(ConfigError, match=r"^host: a CA bundle was given for a ws:// URL, which is not encrypted"):
        OpenPIClient("ws://localhost:1", ca_bundle=pki.ca)
    missing = tmp_path / "missing.pem"
    with pytest.raises(ConfigError, match=rf"^ca_bundle: '{missing}' is not a file; give the PEM file"):
        ActionClient("https://localhost:1", ca_bundle=missing)
    with pytest.raises(ConfigError, match=r"^ca_bundle: '.*not-pem.txt' holds no readable PEM certificate"):
        (tmp_path / "not-pem.txt").write_text("hello")
        OpenPIClient("wss://localhost:1", ca_bundle=str(tmp_path / "not-pem.txt"))
