"""A loopback TCP relay in front of a server that a test can cut: every open connection is closed and the port stops
listening, which is what a client sees of a server that was stopped, while the server itself (a `serve run` other
tests share) keeps running."""

from __future__ import annotations

import socket
import threading


class TcpRelay:
    """`with TcpRelay(port) as relay: relay.port ...; relay.cut()`: relays 127.0.0.1:<relay.port> to :<port>."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.upstream = (host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._cut = False
        self._accepting = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> TcpRelay:
        self._accepting.start()
        return self

    def __exit__(self, *exc) -> None:
        self.cut()
        self._accepting.join(timeout=10)

    def cut(self) -> None:
        """Close the listener and every relayed connection (both ends): new connections are refused from now on."""
        with self._lock:
            self._cut = True
            sockets, self._sockets = [self._listener, *self._sockets], []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # cut
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._cut:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):  # one side ended: end the other, as a direct connection would
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
