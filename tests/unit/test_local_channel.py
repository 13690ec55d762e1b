"""LocalChannel (omni/transport/local.py) between real processes, and shm's copy-free put."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from omni.transport.base import TransportError
from omni.transport.factory import make_consumer, make_producer
from omni.transport.local import MAGIC, MAX_MESSAGE_BYTES, LocalListener, connect_local
from omni.transport.server import client_hello

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 60.0
ECHO = """
import sys
from omni.transport.local import connect_local
ch = connect_local(sys.argv[1], sys.argv[2])
while True:
    msg = ch.recv()
    if msg == b"stop":
        break
    ch.send(msg[::-1])
"""


def echo_child(name: str, token: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", ECHO, name, token], env=env)


def test_round_trips_keep_order_and_boundaries():
    listener = LocalListener(token="sesame")
    child = echo_child(listener.name, "sesame")
    try:
        ch = listener.accept(timeout=DEADLINE)
        msgs = [bytes([i % 251]) * (1 + i * 97 % 5000) for i in range(200)]
        for m in msgs[:10]:       # several in flight: the kernel keeps them apart and in order
            ch.send(m)
        for m in msgs[:10]:
            assert ch.recv(timeout=DEADLINE) == m[::-1]
        for m in msgs[10:]:
            ch.send(m)
            assert ch.recv(timeout=DEADLINE) == m[::-1]
        ch.send(b"stop")
        assert child.wait(timeout=DEADLINE) == 0
        with pytest.raises(ConnectionError, match="closed"):
            ch.recv(timeout=DEADLINE)
        ch.close()
    finally:
        child.kill()
        listener.close()


def test_bad_messages_and_timeouts_raise():
    listener = LocalListener(token="t")
    try:
        client = connect_local(listener.name, "t")
        server = listener.accept(timeout=DEADLINE)
        with pytest.raises(TransportError, match="empty"):
            client.send(b"")
        with pytest.raises(TransportError, match="exceeds"):
            client.send(b"x" * (MAX_MESSAGE_BYTES + 1))
        with pytest.raises(TimeoutError):
            server.recv(timeout=0.01)
        client.send(b"x" * MAX_MESSAGE_BYTES)
        assert len(server.recv(timeout=DEADLINE)) == MAX_MESSAGE_BYTES
        sent = 0
        while client.send(b"y" * 4096, wait=False):   # nobody reads: the buffer fills, no blocking
            sent += 1
            assert sent < 100_000
        assert sent > 0
        for _ in range(sent):                         # everything queued arrives, in one piece each
            assert server.recv(timeout=DEADLINE) == b"y" * 4096
        assert client.send(b"z", wait=False)
        assert server.recv(timeout=DEADLINE) == b"z"
        client.close()
        server.close()
    finally:
        listener.close()


@pytest.mark.parametrize("spin_us", [0, 50, 10_000])
def test_recv_keeps_its_contract_with_or_without_a_spin(spin_us):
    listener = LocalListener(token="t")
    try:
        client = connect_local(listener.name, "t")
        server = listener.accept(timeout=DEADLINE)
        client.send(b"waiting")
        assert server.recv(timeout=DEADLINE, spin_us=spin_us) == b"waiting"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            server.recv(timeout=0.06, spin_us=spin_us)   # the spin counts toward the timeout
        assert time.monotonic() - t0 >= 0.055
        started = threading.Event()
        sender = threading.Thread(target=lambda: (started.wait(DEADLINE), client.send(b"later")))
        sender.start()
        started.set()                  # lands during the spin or after it: either way it is returned
        assert server.recv(timeout=DEADLINE, spin_us=spin_us) == b"later"
        sender.join()
        client.close()
        with pytest.raises(ConnectionError, match="closed"):
            server.recv(spin_us=spin_us)                 # no timeout: the close ends the wait
        server.close()
    finally:
        listener.close()


def test_wrong_token_and_unknown_name_are_refused():
    listener = LocalListener(token="right")
    try:
        with pytest.raises(TransportError, match="refused"):
            connect_local(listener.name, "wrong")
        with pytest.raises(TransportError, match="unreachable"):
            connect_local(listener.name + "-nope", "right")
        with pytest.raises(TimeoutError):
            listener.accept(timeout=0.01)    # the refused peer never became a channel
    finally:
        listener.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another user")
def test_another_user_is_refused_even_with_the_token():
    listener = LocalListener(token="sesame")
    try:
        pid = os.fork()
        if pid == 0:   # child: become nobody, then try with the right token
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                try:   # omni's client refuses a listener of another user ...
                    connect_local(listener.name, "sesame", timeout=DEADLINE)
                    code = 1
                except TransportError as e:
                    code = 0 if "another user" in str(e) else 2
                # ... and the listener refuses a client of another user, token or not
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                    sock.settimeout(DEADLINE)
                    sock.connect("\0" + listener.name)
                    client_hello(sock, MAGIC, "sesame")
                    if sock.recv(1) not in (b"\x01", b""):
                        code = 4
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        listener.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a listener as another user")
def test_shm_consumer_refuses_a_producer_name_held_by_another_user():
    from omni.transport.base import TensorRef

    name = f"omni-shm-{os.getpid()}-squat"
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # child: as nobody, take the name a producer would use; never answer
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.bind("\0" + name)
                sock.listen(1)
                os.write(ready_w, b"1")
                os.read(done_r, 1)
                code = 0
        finally:
            os._exit(code)
    consumer = make_consumer("shm", token="sesame")
    try:
        assert os.read(ready_r, 1) == b"1"
        ref = TensorRef(transport="shm", key=1, endpoint=f"{name}/0", offset=0, nbytes=4, dtype="float32", shape=(1,))
        with pytest.raises(TransportError, match="another user"):
            consumer.get(ref)
    finally:
        consumer.close()
        os.write(done_w, b"1")
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_shm_empty_then_put_copies_nothing():
    producer = make_producer("shm", arena_bytes=1 << 20)
    consumer = make_consumer("shm")
    try:
        out = producer.empty((4, 8), torch.float32, owner="r1")
        torch.arange(32.0, out=out.view(-1))        # the stage writes its output in place
        used = producer.bytes_in_use()
        ref = producer.put(out, owner="r1")
        assert producer.bytes_in_use() == used      # no second slot: the staged one was published
        got = consumer.get(ref)
        assert torch.equal(got, torch.arange(32.0).view(4, 8))
        out[0, 0] = -1.0                            # same memory: the consumer's view sees it
        assert got[0, 0].item() == -1.0
        # a view into a staged slot that is not the whole tensor is copied like any tensor
        part = producer.empty((16,), torch.int32)
        ref2 = producer.put(part[:8])
        assert ref2.offset != ref.offset and producer.bytes_in_use() > used
        producer.free_owner("r1")
        with pytest.raises(TransportError, match="freed"):
            consumer.get(ref)
        staged = producer.empty((1000,), torch.uint8, owner="r2")   # never put: free_owner releases it
        del staged
        before = producer.bytes_in_use()
        producer.free_owner("r2")
        assert producer.bytes_in_use() < before
    finally:
        consumer.close()
        producer.close()


def test_a_send_to_a_closed_peer_is_peer_closed_not_a_fault():
    """A stage's send to a frontend that stopped: its 'frontend is gone' is an INFO line, not a WARNING
    at every frontend stop ('Broken pipe')."""
    from omni.transport.local import PeerClosed

    listener = LocalListener(token="t")
    try:
        client = connect_local(listener.name, "t")
        server = listener.accept(timeout=DEADLINE)
        client.close()
        with pytest.raises(PeerClosed, match="send failed"):
            server.send(b"x", wait=False)
        server.close()
    finally:
        listener.close()
