"""The tests' TCP proxy (tests/support/tcp_proxy.py) forwards while up and refuses while down."""

from __future__ import annotations

import socket
import threading

import pytest

from tests.support.tcp_proxy import TcpProxy


def echo_server() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(
                target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(1024), b"")], daemon=True
            ).start()

    threading.Thread(target=serve, daemon=True).start()
    return server


def roundtrip(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"ping")
        return conn.recv(1024)


def test_forwards_while_up_and_cuts_while_down() -> None:
    server = echo_server()
    with TcpProxy(server.getsockname()[1]) as proxy:
        assert roundtrip(proxy.port) == b"ping"
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        held.sendall(b"a")
        assert held.recv(10) == b"a"
        proxy.down()
        assert held.recv(10) == b""  # the open connection was cut
        with pytest.raises(OSError):
            reply = roundtrip(proxy.port)
            if not reply:
                raise ConnectionResetError("closed")
        proxy.up()
        assert roundtrip(proxy.port) == b"ping"
    server.close()
