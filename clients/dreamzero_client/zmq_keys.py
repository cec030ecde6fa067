"""CURVE keys for the ZeroMQ door and its clients (docs/zmq.md, "Encryption: CURVE").

    python -m dreamzero_client.zmq_keys keys/ server     # keys/server.key (public), keys/server.key_secret (0600)
    python -m dreamzero_client.zmq_keys keys/ robot-1    # a robot's own pair, for a server with an allow-list

The files are ZeroMQ's own certificate format (`zmq.auth.create_certificates`; czmq's zcert reads them too): the
public file (`.key`) may be handed out freely, the secret file (`.key_secret`) stays on its machine. Keys are Z85
text, 40 characters for 32 bytes. Needs the `zmq` extra (pyzmq; its wheels ship libzmq with libsodium).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
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


def read_public_keys_dir(folder: str | os.PathLike, field: str) -> list[bytes]:
    """The public keys of every `*.key` certificate in `folder`."""
    folder = Path(folder).expanduser()
    return [read_public_key(path, f"{field} ({path.name})") for path in sorted(folder.glob("*.key"))]


def make_key_pair(folder: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write `<name>.key` and `<name>.key_secret` (owner-only) in `folder`; refuses to overwrite a pair."""
    import zmq.auth

    folder = Path(folder).expanduser()
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise ConfigError(f"{public} or {secret} exists already: remove it first or choose another name")
    folder.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even for a moment
    try:
        zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old_umask)
    public.chmod(0o644)
    return public, secret


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dreamzero_client.zmq_keys", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="where the two files go (created if missing)")
    p.add_argument("name", help="file name stem: <name>.key (public) and <name>.key_secret (secret)")
    ns = p.parse_args(argv)
    try:
        public, secret = make_key_pair(ns.folder, ns.name)
    except ConfigError as exc:
        print(f"zmq_keys: {exc}", file=sys.stderr)
        return 2
    key = read_public_key(public, "public key").decode()
    print(f"public key {key}\n  {public} (hand this out)\n  {secret} (keep this on its machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
