"""A request's head (request line and headers) is capped at 16 KiB, Hypercorn's h11_max_incomplete_size: 431,
then the connection closes. h11 applies that cap only while a head is incomplete and Hypercorn reads 64 KiB at
a time, so a head arriving in one read passed whatever its size (a 65,000-byte header was a 200).
Real sockets on 127.0.0.1 (omni/api/http1.py)."""

from __future__ import annotations

import socket

import pytest

from omni.api.limits import HttpLimits
from tests.unit.api_fakes import served_in_thread
from tests.unit.test_http1_only import hello, read_until_closed


@pytest.fixture(scope="module")
def server():
    with served_in_thread(hello, HttpLimits()) as addr:
        yield addr


def head(value_len: int) -> bytes:
    return b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nX-A: " + b"a" * value_len + b"\r\n\r\n"


@pytest.mark.parametrize("value_len", [16_000, 16_384 - len(head(0))])
def test_a_head_within_16_kib_is_served(server, value_len):
    with socket.create_connection(server) as s:
        s.sendall(head(value_len))
        got, _ = read_until_closed(s, 10)
    assert got.startswith(b"HTTP/1.1 200 "), got[:100]


@pytest.mark.parametrize("value_len", [16_384 - len(head(0)) + 1, 17_000, 60_000, 65_000, 70_000])
def test_a_head_over_16_kib_is_a_431_whole_or_in_pieces(server, value_len):
    for pieces in (1, 8):
        data = head(value_len)
        with socket.create_connection(server) as s:
            step = -(-len(data) // pieces)
            try:
                for at in range(0, len(data), step):
                    s.sendall(data[at:at + step])
            except OSError:    # refused and closed before the rest went out
                pass
            got, _ = read_until_closed(s, 10)
        assert got.startswith(b"HTTP/1.1 431 "), (value_len, pieces, got[:100])
