"""util.recv_into_exact with a spin: it reads without blocking while bytes come and waits on the
socket's own timeout once they stop, so its contract is the blocking read's."""

from __future__ import annotations

import socket
import threading

import pytest

from omni.transport.util import recv_exact, recv_into_exact

DEADLINE = 60.0


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("spin_s", [0.0, 50e-6, 0.01])
def test_pieces_with_pauses_arrive_whole_and_the_timeout_is_kept(pair, spin_s):
    a, b = pair
    a.settimeout(DEADLINE)
    payload = bytes(range(256)) * 4096          # 1 MiB
    pieces = [payload[i:i + 100_003] for i in range(0, len(payload), 100_003)]
    go = [threading.Event() for _ in pieces]

    def send() -> None:
        for piece, ev in zip(pieces, go):
            ev.wait(DEADLINE)
            b.sendall(piece)

    sender = threading.Thread(target=send)
    sender.start()
    out = bytearray(len(payload))
    reader = threading.Thread(target=recv_into_exact, args=(a, memoryview(out), spin_s))
    reader.start()
    for ev in go:                 # each piece released only once the reader is running (spinning or waiting)
        ev.set()
    reader.join(DEADLINE)
    sender.join(DEADLINE)
    assert bytes(out) == payload
    assert a.gettimeout() == DEADLINE            # the socket is given back as it was


@pytest.mark.parametrize("spin_s", [0.0, 50e-6])
def test_a_close_midway_and_a_silent_peer_raise(pair, spin_s):
    a, b = pair
    a.settimeout(0.05)
    b.sendall(b"abc")
    with pytest.raises(TimeoutError):
        recv_exact(a, 10, spin_s)               # 3 of 10 bytes, then silence past the timeout
    assert a.gettimeout() == 0.05
    a.settimeout(None)
    b.sendall(b"de")
    b.close()
    with pytest.raises(ConnectionError, match="after 2 of 10"):
        recv_exact(a, 10, spin_s)
    assert a.gettimeout() is None
