"""The ZeroMQ client without its extra: the error names the extra to install, not a bare `No module named 'zmq'`
(and is still an ImportError, for code that catches one); and a plain client whose every handshake the server cuts."""

from __future__ import annotations

import socket
import struct
import sys
import threading

import pytest

from dreamzero_client.errors import MissingDependency, SecureChannelError
from dreamzero_client.zmq_client import ZmqPolicyClient


def test_without_pyzmq_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)  # `import zmq` now raises ImportError, as without the package
    with pytest.raises(MissingDependency, match=r"pip install 'dreamzero-client\[zmq\]'") as info:
        ZmqPolicyClient("localhost", 5555, timeout_s=1.0)
    assert isinstance(info.value, ImportError)


def test_a_plain_client_whose_every_handshake_is_reset_names_curve():
    """A CURVE server that resets the connection before the client reads its greeting shows the client no mechanism
    mismatch, only closed handshakes (seen once under load in CI): that is a secure-channel error, not a silent
    timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port, stop = listener.getsockname()[1], threading.Event()

    def reset_every_connection() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(2)
            conn.recv(10)  # the client's ZMTP signature
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            conn.close()

    thread = threading.Thread(target=reset_every_connection, daemon=True)
    thread.start()
    try:
        with ZmqPolicyClient("127.0.0.1", port, timeout_s=1.0) as client:
            with pytest.raises(SecureChannelError, match="closed every handshake .* require CURVE"):
                client.ping()
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
