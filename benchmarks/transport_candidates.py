"""Candidate carriers and physical baselines for benchmarks/transport.py.

- small-message round trips (a ref-sized message, 128 bytes, echoed by a second process):
  ZMQ PAIR ipc with msgpack (how the benchmark carried refs before), ZMQ PAIR ipc with raw
  frames, the same with CURVE (the stage channel's security), ZMQ DEALER/ROUTER ipc with
  CURVE (the stage channel's socket types), omni's LocalChannel (unix SEQPACKET, same-user
  + token hello) blocking at once and polling for up to OMNI_SPIN_US first (as the stage loop
  does), and a raw shared-memory + eventfd doorbell with both processes on one vCPU and on
  two: the wake-up of a halted vCPU, which is what the blocking carriers pay each way.
- iperf-style TCP: one stream over 127.0.0.1, large sends from and receives into
  preallocated buffers, no protocol: what omni's tcp transport is compared against.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import secrets
import socket
import time

import zmq

from omni import envs
from omni.stage.curve import secure_client, secure_server
from omni.transport.local import LocalListener, connect_local

MSG = b"r" * 128
STOP = b"q"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _timed(rounds: int, warmup: int, once) -> list[float]:
    out = []
    for i in range(rounds + warmup):
        t0 = time.perf_counter()
        once()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


# -- ZMQ ------------------------------------------------------------------------------------
def _zmq_echo(addr: str, token: str, router: bool) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER if router else zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    if token:
        secure_server(sock, token)
    sock.bind(addr)
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == STOP:
            break
        sock.send_multipart(frames)
    sock.close(0)
    from omni.stage import curve
    for auth, _keys in curve._authenticators.values():   # its thread must go before the context
        auth.stop()
    ctx.term()


def zmq_roundtrip(rounds: int, *, curve: bool, router: bool = False, msgpack: bool = False) -> list[float]:
    import msgspec

    token = secrets.token_hex(16) if curve else ""
    addr = f"ipc://@omni-bench-zmq-{os.getpid()}-{secrets.token_hex(4)}"
    proc = mp.get_context("spawn").Process(target=_zmq_echo, args=(addr, token, router), daemon=True)
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER if router else zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    if curve:
        secure_client(sock, token)
    sock.connect(addr)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    payload = {"key": 1, "endpoint": "omni-shm-1234-abcd/0", "shape": [1024], "pad": "x" * 60}

    def once() -> None:
        if msgpack:
            sock.send(enc.encode(payload))
            dec.decode(sock.recv())
        else:
            sock.send(MSG)
            sock.recv()

    try:
        return _timed(rounds, 50, once)   # the first round also waits for the bind and handshake
    finally:
        sock.send(STOP)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        sock.close(0)
        ctx.term()


# -- omni LocalChannel -----------------------------------------------------------------------
def _local_echo(name: str, token: str, spin_us: int) -> None:
    ch = connect_local(name, token)
    while True:
        msg = ch.recv(spin_us=spin_us)
        if msg == STOP:
            break
        ch.send(msg)
    ch.close()


def local_roundtrip(rounds: int, spin_us: int = 0) -> list[float]:
    token = secrets.token_hex(16)
    listener = LocalListener(token=token)
    proc = mp.get_context("spawn").Process(target=_local_echo, args=(listener.name, token, spin_us), daemon=True)
    proc.start()
    ch = listener.accept(timeout=60)

    def once() -> None:
        ch.send(MSG)
        ch.recv(timeout=60, spin_us=spin_us)

    try:
        return _timed(rounds, 50, once)
    finally:
        ch.send(STOP)
        proc.join(timeout=30)
        ch.close()
        listener.close()


# -- raw shared memory + eventfd (no framing, no auth: the floor) -----------------------------
def eventfd_roundtrip(rounds: int, cpus: tuple[int, int] | None = None) -> list[float]:
    """`cpus`: pin this process and the echoing child to these two (one vCPU twice, or two)."""
    ping, pong = os.eventfd(0), os.eventfd(0)
    mm = mmap.mmap(-1, 4096)
    mask = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:   # child: only os calls, no threads of ours
        if cpus:
            os.sched_setaffinity(0, {cpus[1]})
        while True:
            os.eventfd_read(ping)
            if mm[0:1] == STOP:
                os._exit(0)
            mm[2048:2048 + len(MSG)] = mm[0:len(MSG)]
            os.eventfd_write(pong, 1)

    def once() -> None:
        mm[0:len(MSG)] = MSG
        os.eventfd_write(ping, 1)
        os.eventfd_read(pong)
        bytes(mm[2048:2048 + len(MSG)])

    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
    try:
        return _timed(rounds, 50, once)
    finally:
        os.sched_setaffinity(0, mask)
        mm[0:1] = STOP
        os.eventfd_write(ping, 1)
        os.waitpid(pid, 0)
        os.close(ping)
        os.close(pong)


def carrier_rows(rounds: int) -> list[dict]:
    cases = [
        ("zmq PAIR ipc + msgpack (benchmark's old ref carrier)", lambda: zmq_roundtrip(rounds, curve=False,
                                                                                     msgpack=True)),
        ("zmq PAIR ipc, raw frames", lambda: zmq_roundtrip(rounds, curve=False)),
        ("zmq PAIR ipc + CURVE", lambda: zmq_roundtrip(rounds, curve=True)),
        ("zmq DEALER/ROUTER ipc + CURVE (stage channel)", lambda: zmq_roundtrip(rounds, curve=True, router=True)),
        ("omni LocalChannel (unix SEQPACKET, authenticated)", lambda: local_roundtrip(rounds)),
        (f"omni LocalChannel, both ends poll {envs.OMNI_SPIN_US} us first", lambda: local_roundtrip(
            rounds, envs.OMNI_SPIN_US)),
        ("raw shm + eventfd doorbell (no auth)", lambda: eventfd_roundtrip(rounds)),
    ]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        cases += [("raw shm + eventfd, both on one vCPU (no halt)", lambda: eventfd_roundtrip(rounds, (cpus[0],) * 2)),
                  ("raw shm + eventfd, one vCPU each (wakes a halted one)",
                   lambda: eventfd_roundtrip(rounds, (cpus[0], cpus[1])))]
    rows = []
    for name, run in cases:
        s = run()
        rows.append({"carrier": name, "p50_us": round(pct(s, 0.5) * 1e6, 1), "p99_us": round(pct(s, 0.99) * 1e6, 1)})
    return rows


# -- iperf-style TCP -------------------------------------------------------------------------
CHUNK = 16 << 20


def _tcp_sink_sender(port: int, total: int, chunk: int = CHUNK) -> None:
    buf = bytearray(chunk)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(buf)
        sent = 0
        while sent < total:
            n = min(chunk, total - sent)
            s.sendall(view[:n])
            sent += n
        s.recv(1)   # wait for the receiver's ack, so the close does not race the timing


def iperf_loopback(total: int, repeats: int = 3, chunk: int = CHUNK) -> float:
    """Best-of-`repeats` GB/s of one TCP stream over 127.0.0.1 (child sends, we receive), both
    ends reusing one `chunk`-byte buffer."""
    best = 0.0
    for _ in range(repeats):
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        pid = os.fork()
        if pid == 0:
            try:
                _tcp_sink_sender(port, total, chunk)
            finally:
                os._exit(0)
        conn, _ = srv.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        got = 0
        t0 = time.perf_counter()
        while got < total:
            k = conn.recv_into(view, min(chunk, total - got))
            if k == 0:
                break
            got += k
        dt = time.perf_counter() - t0
        conn.send(b"k")
        os.waitpid(pid, 0)
        conn.close()
        srv.close()
        best = max(best, got / dt / 1e9)
    return best


# -- first touch of fresh shared memory ------------------------------------------------------
def first_touch(nbytes: int) -> dict:
    """put() into a fresh arena (every page faults in) vs the same slot again (pages present)."""
    import torch

    from omni.transport.factory import make_producer

    producer = make_producer("shm", arena_bytes=nbytes + (1 << 20))
    try:
        x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            ref = producer.put(x)
            times.append(time.perf_counter() - t0)
            producer.free([ref.key])
    finally:
        producer.close()
    warm = sorted(times[1:])[1]
    return {"bytes": nbytes, "cold_us": round(times[0] * 1e6, 1), "warm_us": round(warm * 1e6, 1),
            "cold_over_warm": round(times[0] / warm, 2)}


# -- CPU cost of put/get, in one process (thread CPU time: holds up under load) ---------------
def shm_cpu_costs(sizes: list[int], budget_s: float = 0.2) -> list[dict]:
    """Per hand-off CPU microseconds of the producer's put + ref encode + free (also with a
    staged tensor: empty() + put) and of the consumer's ref decode + get; best of 3 batches.
    What a hand-off adds to the carrier's round trip."""
    import msgspec
    import torch

    from omni.transport.base import TensorRef
    from omni.transport.factory import make_consumer, make_producer

    producer = make_producer("shm", arena_bytes=max(sizes) + (1 << 20))
    consumer = make_consumer("shm")
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(TensorRef)
    rows = []
    try:
        for n in sizes:
            x = torch.randint(0, 256, (n,), dtype=torch.uint8)
            ref = producer.put(x)
            producer.free([ref.key])   # the slot's pages are now faulted in
            t0 = time.thread_time()
            producer.free([producer.put(x).key])
            reps = max(3, min(2000, int(budget_s / 3 / max(time.thread_time() - t0, 1e-6))))
            put_s = get_s = staged_s = float("inf")
            for _ in range(3):
                t0 = time.thread_time()
                for _ in range(reps):
                    r = producer.put(x, owner="b")
                    wire = enc.encode(r)
                    producer.free([r.key])
                put_s = min(put_s, (time.thread_time() - t0) / reps)
                t0 = time.thread_time()
                for _ in range(reps):
                    r = producer.put(producer.empty((n,), torch.uint8, owner="b"), owner="b")
                    wire = enc.encode(r)
                    producer.free([r.key])
                staged_s = min(staged_s, (time.thread_time() - t0) / reps)
                r = producer.put(x)
                wire = enc.encode(r)
                t0 = time.thread_time()
                for _ in range(reps):
                    consumer.get(dec.decode(wire))
                get_s = min(get_s, (time.thread_time() - t0) / reps)
                producer.free([r.key])
            rows.append({"bytes": n, "put_cpu_us": round(put_s * 1e6, 1), "staged_put_cpu_us": round(staged_s * 1e6, 1),
                         "get_cpu_us": round(get_s * 1e6, 1)})
    finally:
        consumer.close()
        producer.close()
    return rows
