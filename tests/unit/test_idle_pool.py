"""The sinks' pool of idle connections (``sequin_provider.sinks.idle_pool``): what it hands out,
what it passes over and closes. The pool's own logic only: the connections here are stand-ins
with a ``close``; each sink's pool runs against its real server in tests/integration/sinks."""

from __future__ import annotations

import socket
import threading

from sequin_provider.sinks.idle_pool import IdlePool, readable


class Conn:
    """A stand-in connection: whether it is open, and whether it was closed."""

    def __init__(self, name: str, open_: bool = True) -> None:
        self.name = name
        self.open = open_
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_an_empty_pool_hands_out_nothing_and_a_given_connection_comes_back() -> None:
    pool: IdlePool[Conn] = IdlePool()
    assert pool.take() is None
    a = Conn("a")
    pool.give(a)
    assert pool.take() is a
    assert pool.take() is None
    assert not a.closed


def test_an_unusable_idle_connection_is_closed_and_passed_over() -> None:
    pool: IdlePool[Conn] = IdlePool(lambda c: c.open)
    gone, fine = Conn("gone", open_=False), Conn("fine")
    pool.give(gone)
    pool.give(fine)
    assert pool.take() is fine
    assert gone.closed and not fine.closed
    assert pool.take() is None


def test_close_closes_every_idle_connection_and_leaves_the_pool_usable() -> None:
    pool: IdlePool[Conn] = IdlePool()
    conns = [Conn(str(n)) for n in range(3)]
    for c in conns:
        pool.give(c)
    pool.close()
    assert all(c.closed for c in conns)
    assert pool.take() is None
    later = Conn("later")
    pool.give(later)  # a lane giving back after the sink's close
    assert pool.take() is later


def test_lanes_sharing_the_pool_never_get_the_same_connection() -> None:
    pool: IdlePool[Conn] = IdlePool()
    for n in range(200):
        pool.give(Conn(str(n)))
    taken: list[list[Conn]] = [[] for _ in range(4)]

    def lane(mine: list[Conn]) -> None:
        while (conn := pool.take()) is not None:
            mine.append(conn)

    threads = [threading.Thread(target=lane, args=(t,)) for t in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = [c.name for mine in taken for c in mine]
    assert sorted(names, key=int) == [str(n) for n in range(200)]


def test_readable_tells_what_the_peer_sent_or_its_end_without_waiting() -> None:
    """On a real socket pair: nothing to read, then the peer's bytes, then (read) nothing, then
    the peer's close; by socket and by file descriptor."""
    mine, peer = socket.socketpair()
    with mine, peer:
        assert not readable(mine) and not readable(mine.fileno())
        peer.sendall(b"PING\r\n")
        assert readable(mine) and readable(mine.fileno())
        assert mine.recv(64) == b"PING\r\n"
        assert not readable(mine)
        peer.close()
        assert readable(mine) and mine.recv(64) == b""  # the end of the connection
