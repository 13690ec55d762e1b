"""A producer that stops answering holds one read for the timeout, not every read after it
(omni/transport/down.py)."""

import socket
import threading

import pytest
import torch

from omni.transport import tcp
from omni.transport.base import TensorRef, TransportError
from omni.transport.down import DownProducers
from omni.transport.tcp import TcpConsumer, TcpProducer


@pytest.fixture
def silent():
    """A listener that takes connections and never says a word (a host gone quiet), counting them."""
    srv = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.05)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except TimeoutError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}", conns
    stop.set()
    t.join(5)
    for c in conns:
        c.close()
    srv.close()


def _ref(endpoint: str) -> TensorRef:
    return TensorRef(transport="tcp", endpoint=endpoint, key=1, dtype="float32", shape=(1,), nbytes=4)


def test_after_a_timed_out_read_the_producer_is_not_tried_again_for_a_while(silent):
    endpoint, conns = silent
    now = [100.0]
    consumer = TcpConsumer(timeout=0.2)
    consumer._down = DownProducers(hold_s=10.0, clock=lambda: now[0])
    with pytest.raises(TransportError, match="handshake failed"):
        consumer.get(_ref(endpoint))                 # waits its timeout: the host was not known to be gone
    assert len(conns) == 1
    with pytest.raises(TransportError, match=r"is not answering \(a connect timed out 0.0 s ago\)"):
        consumer.get(_ref(endpoint))                 # before: a new connection and another whole timeout
    assert len(conns) == 1
    now[0] += 10.0
    with pytest.raises(TransportError, match="handshake failed"):
        consumer.get(_ref(endpoint))                 # held long enough: one read tries again
    assert len(conns) == 2
    consumer.close()


def test_a_refused_connection_is_not_held_and_a_live_producer_reads_on(silent):
    endpoint, _ = silent
    producer = TcpProducer(host="127.0.0.1")
    consumer = TcpConsumer(timeout=5.0)
    try:
        ref = producer.put(torch.arange(4.0))
        assert consumer.get(ref).tolist() == [0.0, 1.0, 2.0, 3.0]
        dead = socket.create_server(("127.0.0.1", 0))
        gone = f"127.0.0.1:{dead.getsockname()[1]}"
        dead.close()
        for _ in range(2):                           # refused both times: nothing is held
            with pytest.raises(TransportError, match="unreachable"):
                consumer.get(_ref(gone))
        assert consumer.get(ref).tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        consumer.close()
        producer.close()


def test_connect_waits_less_than_a_read(monkeypatch):
    seen = {}

    def create_connection(addr, timeout):
        seen["timeout"] = timeout
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", create_connection)
    with pytest.raises(TransportError, match="unreachable"):
        tcp.connect("10.255.255.1:9", None, 30.0)
    assert seen["timeout"] == tcp.CONNECT_TIMEOUT_S < 30.0


def test_after_the_hold_one_read_probes_and_a_success_lifts_the_hold():
    now = [0.0]
    producer = TcpProducer(host="127.0.0.1")
    consumer = TcpConsumer(timeout=5.0)
    consumer._down = down = DownProducers(hold_s=10.0, clock=lambda: now[0])
    try:
        ref = producer.put(torch.arange(2.0))
        down.mark(ref.endpoint, "a read timed out")
        with pytest.raises(TransportError, match="not answering"):
            consumer.get(ref)
        now[0] += 10.0
        down.check(ref.endpoint)                     # the probe goes...
        with pytest.raises(TransportError, match="not answering"):
            down.check(ref.endpoint)                 # ...while the others still fail at once
        now[0] += 10.0
        assert consumer.get(ref).tolist() == [0.0, 1.0]   # the next probe reads: the hold is lifted
        down.check(ref.endpoint)
        down.check(ref.endpoint)
    finally:
        consumer.close()
        producer.close()
