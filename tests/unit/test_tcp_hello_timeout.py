"""A tcp/gloo producer whose host is alive but whose process does not answer (SIGSTOPped, wedged):
its kernel still accepts the connection, so the wait is in the hello. The hello is under the short
connect timeout (tcp.CONNECT_TIMEOUT_S), not the payload read's (30 s), which a consuming stage
spent on its loop thread; the producer is then held as down and later reads fail at once."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from omni.transport import tcp
from omni.transport.base import TensorRef, TransportError


@pytest.fixture
def hung():
    """A listener that never accepts: connects succeed, nothing is ever said."""
    s = socket.create_server(("127.0.0.1", 0))
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


def test_the_hello_waits_the_connect_timeout_not_the_read_timeout(hung, monkeypatch):
    monkeypatch.setattr(tcp, "CONNECT_TIMEOUT_S", 0.2)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="handshake failed"):
        tcp.connect(hung, "t", timeout=3.0)
    assert time.monotonic() - t0 < 1.5            # was the whole 3 s


def test_a_silent_producer_is_down_after_one_short_wait(hung, monkeypatch):
    monkeypatch.setattr(tcp, "CONNECT_TIMEOUT_S", 0.2)
    consumer = tcp.TcpConsumer(token="t", timeout=3.0)
    ref = TensorRef(transport="tcp", endpoint=hung, key=1, dtype="float32", shape=(4,), nbytes=16)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            consumer.get(ref)
        with pytest.raises(TransportError, match="timed out"):
            consumer.get(ref)                     # held as down: at once
        assert time.monotonic() - t0 < 1.5
    finally:
        consumer.close()


def test_reads_keep_the_payload_timeout():
    producer = tcp.TcpProducer(token="t")
    try:
        ref = producer.put(torch.arange(4, dtype=torch.float32))
        sock = tcp.connect(producer.endpoint, "t", timeout=30.0)
        try:
            assert sock.gettimeout() == 30.0
        finally:
            sock.close()
        consumer = tcp.TcpConsumer(token="t")
        try:
            assert consumer.get(ref).tolist() == [0.0, 1.0, 2.0, 3.0]
        finally:
            consumer.close()
    finally:
        producer.close()
