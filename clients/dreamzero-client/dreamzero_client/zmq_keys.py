"""Reading CURVE key files (docs/zmq.md, "Encryption: CURVE"): the ZeroMQ client reads its own pair and the
server's public key, the door its secret key and the allowed clients' public keys. The files are ZeroMQ's certificate
format (`.key` public, `.key_secret` secret; `dreamzero-zmq-keys` or pyzmq's `zmq.auth.create_certificates` writes
them); keys are Z85 text, 40 characters for 32 bytes. Needs the `zmq` extra (pyzmq).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dreamzero_client.errors import ConfigError

#: a CURVE key in Z85: 40 characters of ZeroMQ's Z85 alphabet
Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


def check_key(key: str | bytes, field: str) -> bytes:
    """`key` as Z85 bytes, or ConfigError naming `field`."""
    text = key.decode("ascii", "replace") if isinstance(key, bytes) else str(key)
    if not Z85_KEY.match(text):
        raise ConfigError(f"{field}: expected a CURVE key in Z85 (40 characters), got {len(text)} characters")
    return text.encode("ascii")


def read_secret_key(path: str | os.PathLike, field: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a `.key_secret` certificate or a file holding only the Z85 secret key."""
    import zmq
    import zmq.auth

    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{field}: cannot read {str(path)!r} ({type(exc).__name__}: {exc})") from None
    if Z85_KEY.match(text):  # a bare key, e.g. a mounted Kubernetes secret
        secret = text.encode("ascii")
        return zmq.curve_public(secret), secret
    try:
        public, secret = zmq.auth.load_certificate(path)
    except ValueError:
        public, secret = None, None
    if public is None or secret is None:
        raise ConfigError(
            f"{field}: {str(path)!r} holds no secret-key: give the <name>.key_secret certificate (or a file holding "
            "only the Z85 secret key), not the public <name>.key"
        )
    return check_key(public, field), check_key(secret, field)


def read_public_key(value: str | bytes | os.PathLike, field: str) -> bytes:
    """A Z85 public key given as itself or as the path of a certificate file (`.key` or `.key_secret`)."""
    import zmq.auth

    path = Path(os.fsdecode(value)).expanduser()
    if not path.is_file():  # a file first: a 40-character path may look like a key
        if Z85_KEY.match(os.fsdecode(value)):
            return check_key(value, field)
        raise ConfigError(f"{field}: neither a Z85 public key (40 characters) nor a certificate file: {str(value)!r}")
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{field}: {str(path)!r} is not a ZeroMQ certificate ({exc})") from None
    return check_key(public, field)
