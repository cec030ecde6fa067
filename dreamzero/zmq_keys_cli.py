"""`dreamzero-zmq-keys`: make a CURVE key pair for the ZeroMQ door or a robot (docs/zmq.md, "Encryption: CURVE").

    dreamzero-zmq-keys keys/ server     # keys/server.key (public), keys/server.key_secret (0600)
    dreamzero-zmq-keys keys/ robot-1    # a robot's own pair, for a server with an allow-list

The files are ZeroMQ's own certificate format (`zmq.auth.create_certificates`; czmq's zcert reads them too): the
public file (`.key`) may be handed out freely, the secret file (`.key_secret`) stays on its machine. The door and the
robot's client read them with `dreamzero_client.zmq_keys`; a robot with only the client package makes its pair with
pyzmq (`zmq.auth.create_certificates`, or `zmq.curve_keypair()` for bare Z85 keys).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dreamzero.errors import ConfigError


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
    p = argparse.ArgumentParser(prog="dreamzero-zmq-keys", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="where the two files go (created if missing)")
    p.add_argument("name", help="file name stem: <name>.key (public) and <name>.key_secret (secret)")
    ns = p.parse_args(argv)
    try:
        if not ns.name or Path(ns.name).name != ns.name:  # a path here would write outside `folder`
            raise ConfigError(f"name: a file name stem such as 'server', got {ns.name!r}")
        public, secret = make_key_pair(ns.folder, ns.name)
        import zmq.auth

        key = zmq.auth.load_certificate(public)[0].decode()
    except (ConfigError, OSError) as exc:  # OSError: a folder that cannot be made or written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"error: dreamzero-zmq-keys needs pyzmq ({exc}): pip install 'pyzmq>=26'", file=sys.stderr)
        return 2
    print(f"public key {key}\n  {public} (hand this out)\n  {secret} (keep this on its machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
