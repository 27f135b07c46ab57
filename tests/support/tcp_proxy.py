"""A TCP proxy in front of a real server (Redis, NATS, RabbitMQ, Postgres) that a test can take down
and bring back: the machine's servers are shared and must not be stopped, so "the destination is
down" is this proxy refusing it.

    with TcpProxy(6379) as proxy:          # the sink's config points at 127.0.0.1:proxy.port
        proxy.down()                       # open connections are cut, new ones closed at once
        ...
        proxy.up()
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Forwards 127.0.0.1:``port`` (chosen free) to ``target_host``:``target_port`` while up."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._up = threading.Event()
        self._up.set()
        self._closed = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, daemon=True, name=f"tcp-proxy-{self.port}")

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_up(self) -> bool:
        """Whether connections are forwarded."""
        return self._up.is_set()

    def down(self) -> None:
        """Cut every open connection; until ``up``, a new connection is closed as soon as it is accepted."""
        self._up.clear()
        self._cut_all()

    def up(self) -> None:
        """Forward new connections again."""
        self._up.set()

    def close(self) -> None:
        """Stop listening and cut everything."""
        self._closed = True
        self._up.clear()
        try:
            self._listener.close()
        except OSError:
            pass
        self._cut_all()

    def _cut_all(self) -> None:
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._open.update((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
