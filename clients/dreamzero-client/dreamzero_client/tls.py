"""TLS for the HTTP and WebSocket clients (docs/clients.md, "TLS"): the context that always verifies the server's
certificate and host name (against `ca_bundle`, else the system trust store; no switch turns it off), and what a
failed check says. Standard library only (`ssl`).
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from pathlib import Path

from dreamzero_client.errors import ConfigError, SecureChannelError

SECURE_SCHEMES = ("https", "wss")


def is_loopback(host: str | None) -> bool:
    """True for localhost and loopback addresses: both clients then skip proxies from the environment."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


#: OpenSSL verify codes -> what to do about them (the reason itself comes from OpenSSL)
_UNTRUSTED = {2, 18, 19, 20, 21}  # no path to a trusted CA: self-signed, unknown issuer
_WRONG_HOST = {62, 64}  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_HINTS = {
    10: "the server's certificate must be renewed",
    9: "the certificate is not valid yet: compare the clocks of both machines",
}


def check_scheme(scheme: str, ca_bundle: str | os.PathLike | None, url_field: str) -> None:
    """ConfigError when a CA bundle comes with a URL that is not encrypted."""
    if ca_bundle is not None and scheme not in SECURE_SCHEMES:
        raise ConfigError(
            f"{url_field}: a CA bundle was given for a {scheme}:// URL, which is not encrypted; use https:// or wss://"
        )


def client_context(ca_bundle: str | os.PathLike | None = None, field: str = "ca_bundle") -> ssl.SSLContext:
    """A context that verifies the server's certificate and host name against `ca_bundle` or the system store."""
    if ca_bundle is None:
        return ssl.create_default_context()
    path = Path(ca_bundle).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"{field}: {str(ca_bundle)!r} is not a file; give the PEM file of the CA certificate(s) that signed the "
            "server's certificate"
        )
    try:
        return ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{field}: {str(path)!r} holds no readable PEM certificate ({exc})") from None


def secure_channel_error(exc: BaseException, where: str) -> SecureChannelError | None:
    """The SecureChannelError for a failure TLS caused (anywhere in `exc`'s chain), else None. A truncated handshake
    (a restarting server, a load balancer) is left to the caller's retries."""
    for err in _chain(exc):
        if isinstance(err, ssl.SSLCertVerificationError):
            reason = (err.verify_message or err.reason or str(err)).rstrip(".")
            return SecureChannelError(
                f"TLS: the certificate of {where} did not verify: {reason}; {_hint(err.verify_code)}", reason
            )
        if isinstance(err, ssl.SSLError) and not isinstance(err, ssl.SSLEOFError | ssl.SSLZeroReturnError):
            reason = err.reason or str(err)
            return SecureChannelError(
                f"TLS: the handshake with {where} failed: {reason} (does that port serve TLS?)", reason
            )
    return None


def _hint(code: int | None) -> str:
    if code in _UNTRUSTED:
        return "pass the CA certificate that signed it (ca_bundle / --ca-bundle)"
    if code in _WRONG_HOST:
        return "connect by a name the certificate carries (its subjectAltName) or reissue it for this host"
    return _HINTS.get(code, "fix the server's certificate or the CA bundle")


def _chain(exc: BaseException):
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__
