"""Certificates made at run time for the TLS tests (the `cryptography` package), and a TLS server of the kind Serve's
proxy runs (uvicorn with `ssl_keyfile` / `ssl_certfile`), in a thread, for the client-side cases: `tls_servers` runs
a small /health + OpenPI WebSocket app (`openpi_app`) behind each certificate (the unit tier's `tls_servers` fixture).

    pki = make_pki(tmp_path)
    pki.ca                  # PEM of the test CA: the clients' ca_bundle
    pki.localhost           # (cert, key) for DNS:localhost, valid now
    pki.other_host          # (cert, key) for DNS:other.example only
    pki.expired             # (cert, key) for DNS:localhost, expired yesterday
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dreamzero_client.wire import openpi
from tests.support.host import free_port


@dataclass(frozen=True)
class Pki:
    ca: Path
    other_ca: Path  # a CA that signed none of the certificates below
    localhost: tuple[Path, Path]
    other_host: tuple[Path, Path]
    expired: tuple[Path, Path]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, cert: x509.Certificate, key=None) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        key_path = path.with_suffix(".key")
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        key_path.chmod(0o600)
    return path


def _ca(common_name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=30))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(ca_cert, ca_key, dns: str, not_before: dt.datetime, not_after: dt.datetime):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(dns))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def make_pki(folder: Path) -> Pki:
    """A test CA, an unrelated CA, and three server certificates signed by the first (files under `folder`)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _ca("dreamzero test CA")
    other_cert, _ = _ca("some other CA")
    now = dt.datetime.now(dt.timezone.utc)
    day = dt.timedelta(days=1)
    leaves = {
        "localhost": _leaf(ca_cert, ca_key, "localhost", now - day, now + 30 * day),
        "other_host": _leaf(ca_cert, ca_key, "other.example", now - day, now + 30 * day),
        "expired": _leaf(ca_cert, ca_key, "localhost", now - 30 * day, now - day),
    }
    pairs = {}
    for name, (cert, key) in leaves.items():
        crt = _write(folder / f"{name}.crt", cert, key)
        pairs[name] = (crt, crt.with_suffix(".key"))
    return Pki(ca=_write(folder / "ca.crt", ca_cert), other_ca=_write(folder / "other-ca.crt", other_cert), **pairs)


class TlsServer:
    """`app` (ASGI) served by uvicorn over TLS with the given certificate on a free loopback port, in a thread:
    the same `ssl_keyfile` / `ssl_certfile` arguments Serve's proxy hands uvicorn. Without a certificate: plain HTTP.
    """

    def __init__(self, app, cert: tuple[Path, Path] | None):
        import uvicorn

        self.port = free_port()
        ssl = {"ssl_certfile": str(cert[0]), "ssl_keyfile": str(cert[1])} if cert else {}
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical", lifespan="off", **ssl)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # not the main thread
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> TlsServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the TLS test server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


#: what `openpi_app`'s WebSocket sends on connect
HANDSHAKE = {"server": "tls-test"}


async def openpi_app(scope, receive, send):
    """/health in JSON and an OpenPI-shaped WebSocket (handshake, then `{"actions": ...}` per frame)."""
    if scope["type"] == "http":
        body = json.dumps({"status": "ok", "scheme": scope["scheme"]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    elif scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "bytes": openpi.pack_frame(HANDSHAKE)})
        while (msg := await receive())["type"] == "websocket.receive":
            obs, _ = openpi.unpack_frame(msg["bytes"])
            reply = {"actions": np.full((2, 8), float(obs["step"]), np.float32), "scheme": scope["scheme"]}
            await send({"type": "websocket.send", "bytes": openpi.pack_frame(reply)})


@contextmanager
def tls_servers(pki: Pki) -> Iterator[dict[str, int]]:
    """name -> port: `openpi_app` behind each certificate of `pki` ("good", "other_host", "expired"), and once in
    plain HTTP ("plain"); all stopped on exit."""
    certs = {"good": pki.localhost, "other_host": pki.other_host, "expired": pki.expired, "plain": None}
    with ExitStack() as stack:
        yield {name: stack.enter_context(TlsServer(openpi_app, cert)).port for name, cert in certs.items()}
