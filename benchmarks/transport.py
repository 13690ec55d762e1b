"""Tensor transports side by side: memcpy, shm, tcp and gloo, 4 KiB .. 64 MiB.

Producer and consumer are two processes linked by a ZMQ PAIR ipc socket that carries
msgpack-encoded requests and TensorRefs, as refs travel in omni. One timed iteration,
measured in the consumer:

    consumer --request(size, ack of the previous key)--> producer
    producer: put(tensor)   shm: copy into the arena | tcp/gloo: keep a reference
    producer --TensorRef--> consumer
    consumer: get(ref)      shm: header check + zero-copy view (bytes not touched)
                            tcp: recv_into a fresh tensor | gloo: process-group recv

so shm's number is "producer copy into shared memory + ref round trip + map", the
whole cost of handing a tensor over on one host. memcpy is one thread's torch
`copy_` into a preallocated buffer of the same size, in one process. GB/s = bytes / p50.

    .venv/bin/python benchmarks/transport.py           # --quick (default, < 2 min)
    .venv/bin/python benchmarks/transport.py --full
    .venv/bin/python benchmarks/transport.py --json    # one JSON document on stdout
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

from omni.transport.base import TensorRef  # noqa: E402
from omni.transport.factory import make_consumer, make_producer  # noqa: E402

KINDS = ("shm", "tcp", "gloo")
QUICK = {4 << 10: 300, 64 << 10: 200, 1 << 20: 60, 16 << 20: 12, 64 << 20: 6}
FULL = {4 << 10: 2000, 16 << 10: 2000, 64 << 10: 1000, 256 << 10: 500, 1 << 20: 200,
        4 << 20: 80, 16 << 20: 40, 64 << 20: 15}
WARMUP = 3


ECHO, STOP = -2, -1


class Req(msgspec.Struct, frozen=True, array_like=True):
    nbytes: int          # STOP, ECHO (answer the last ref again, no put), or a payload size
    ack: int = 0         # key of the previous tensor, freed before the next put


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def row(transport: str, nbytes: int, samples_s: list[float]) -> dict:
    p50 = pct(samples_s, 0.5)
    return {"transport": transport, "bytes": nbytes, "p50_us": round(p50 * 1e6, 1),
            "p99_us": round(pct(samples_s, 0.99) * 1e6, 1), "gbps": round(nbytes / p50 / 1e9, 3)}


def bench_memcpy(sizes: dict[int, int]) -> list[dict]:
    rows = []
    for nbytes, iters in sizes.items():
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        samples = []
        for i in range(iters + WARMUP):
            t0 = time.perf_counter()
            dst.copy_(src)
            if i >= WARMUP:
                samples.append(time.perf_counter() - t0)
        rows.append(row("memcpy", nbytes, samples))
    return rows


def producer_main(kind: str, addr: str, sizes: list[int]) -> None:
    torch.set_num_threads(1)
    producer = make_producer(kind, arena_bytes=160 << 20) if kind == "shm" else make_producer(kind)
    payloads = {n: torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(addr)
    dec = msgspec.msgpack.Decoder(Req)
    enc = msgspec.msgpack.Encoder()
    echo = enc.encode(TensorRef(transport=kind, endpoint="-", key=0, dtype="uint8", shape=(0,), nbytes=0))
    try:
        while True:
            req = dec.decode(sock.recv())
            if req.ack:
                producer.free([req.ack])
            if req.nbytes == STOP:
                break
            if req.nbytes == ECHO:
                sock.send(echo)
                continue
            sock.send(enc.encode(producer.put(payloads[req.nbytes], owner="bench")))
    finally:
        sock.close(linger=0)
        ctx.term()
        producer.close()


def bench_transport(kind: str, sizes: dict[int, int], floor: list[float]) -> list[dict]:
    addr = f"ipc://@omni-bench-{os.getpid()}-{kind}-{secrets.token_hex(4)}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(addr)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    proc = mp.get_context("spawn").Process(target=producer_main, args=(kind, addr, list(sizes)), daemon=True)
    proc.start()
    consumer = make_consumer(kind)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(TensorRef)
    rows, ack = [], 0
    try:
        for i in range(200 + WARMUP):  # the notification floor: the ref round trip alone
            t0 = time.perf_counter()
            sock.send(enc.encode(Req(ECHO)))
            dec.decode(sock.recv())
            if i >= WARMUP:
                floor.append(time.perf_counter() - t0)
        for nbytes, iters in sizes.items():
            samples = []
            for i in range(iters + WARMUP):
                t0 = time.perf_counter()
                sock.send(enc.encode(Req(nbytes, ack)))
                try:
                    ref = dec.decode(sock.recv())
                except zmq.Again:
                    raise SystemExit(f"{kind} producer did not answer within 60 s (alive: {proc.is_alive()})") from None
                tensor = consumer.get(ref)
                dt = time.perf_counter() - t0
                assert tensor.numel() == nbytes
                del tensor
                ack = ref.key
                if i >= WARMUP:
                    samples.append(dt)
            rows.append(row(kind, nbytes, samples))
        sock.send(enc.encode(Req(STOP, ack)))
        proc.join(timeout=30)
    finally:
        consumer.close()
        if proc.is_alive():
            proc.kill()
            proc.join()
        sock.close(linger=0)
        ctx.term()
    return rows


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def print_table(rows: list[dict], sizes: list[int], floor: list[float]) -> None:
    kinds = ["memcpy", *KINDS]
    by = {(r["transport"], r["bytes"]): r for r in rows}
    head = f"{'size':>8} | " + " | ".join(f"{k + ' p50/p99 us, GB/s':^32}" for k in kinds)
    print("\n\n".join(__doc__.split("\n\n")[1:3]) + "\n")
    print(head)
    print("-" * len(head))
    for n in sizes:
        cells = []
        for k in kinds:
            r = by[(k, n)]
            cells.append(f"{r['p50_us']:>10.1f} {r['p99_us']:>10.1f} {r['gbps']:>8.2f}  ")
        print(f"{human(n):>8} | " + " | ".join(cells))
    print(f"\nref round trip over the ZMQ PAIR alone (no put/get): p50 {pct(floor, 0.5) * 1e6:.1f} us, "
          f"p99 {pct(floor, 0.99) * 1e6:.1f} us")
    for n in sizes:
        if n >= 1 << 20:
            ratio = by[("shm", n)]["gbps"] / by[("memcpy", n)]["gbps"]
            print(f"shm / memcpy bandwidth at {human(n)}: {ratio:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer iterations (default)")
    mode.add_argument("--full", action="store_true", help="more sizes and iterations")
    ap.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = FULL if args.full else QUICK
    rows = bench_memcpy(sizes)
    floor: list[float] = []
    for kind in KINDS:
        print(f"running {kind} ...", file=sys.stderr, flush=True)
        rows += bench_transport(kind, sizes, floor)
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print_table(rows, list(sizes), floor)


if __name__ == "__main__":
    main()
