"""A TCP proxy that can stall: it stops forwarding bytes without closing either connection (what a
dead middlebox or a partitioned link does). Used by tests/reliability/test_network_stall.py (the
whole rollout worker) and tests/teacher/client/test_client_stall.py (the teacher client alone)."""

from __future__ import annotations

import contextlib
import socket
import threading


class StallingProxy:
    """127.0.0.1:<port> -> upstream. `stall()` stops forwarding in both directions (connections stay
    open, new ones are accepted and left silent); `restore()` resumes forwarding. It binds its own
    port (port 0: the system picks a free one)."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.forwarding = threading.Event()
        self.forwarding.set()
        self.closed = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stall(self) -> None:
        self.forwarding.clear()

    def restore(self) -> None:
        self.forwarding.set()

    def close(self) -> None:
        self.closed.set()
        self.forwarding.set()
        for s in [self.sock, *self.conns]:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> StallingProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self.closed.is_set():
                self.forwarding.wait()
                data = src.recv(65536)
                if not data:
                    break
                self.forwarding.wait()  # a chunk read just before the stall is held, not forwarded
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
