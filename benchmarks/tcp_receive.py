"""How the tcp consumer's receive buffer bounds a 64 MiB transfer, side by side with iperf-style.

One producer process holds a 64 MiB tensor (omni TcpProducer); this process fetches it again
and again over one connection (the RCVBUF variants over their own), rotating through the receive variants each round, so a load
change hits them all alike:

  get, pooled       TcpConsumer.get(): a reused buffer from its pool (omni/transport/recvpool.py)
  get, fresh        TcpConsumer(pool_bytes=0).get(): a fresh torch.empty each time (before the pool)
  fresh + POPULATE  fresh torch.empty, madvise(MADV_POPULATE_WRITE) on it, then recv_into
  fresh MAP_POPULATE  a fresh mmap(MAP_POPULATE) buffer, then recv_into
  reused, chunk N   recv_into one preallocated buffer, at most N bytes per call
  reused, RCVBUF N  the same on a connection with SO_RCVBUF = N (turns off autotuning; the
                    kernel caps it at net.core.rmem_max and doubles it)

iperf-style: one TCP stream over 127.0.0.1 into a reused 16 MiB buffer
(benchmarks/transport_candidates.py), the goal's yardstick: the median of 3 runs before
and 3 after the rounds. The same with 64 MiB buffers on both ends (a tensor's size, so
neither end's buffer stays in cache) is printed for comparison.

    .venv/bin/python benchmarks/tcp_receive.py [--quick | --full] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.transport_candidates import iperf_loopback  # noqa: E402
from omni.transport.base import TensorRef  # noqa: E402
from omni.transport.factory import make_consumer, make_producer  # noqa: E402
from omni.transport.tcp import connect, request  # noqa: E402
from omni.transport.util import as_memoryview, recv_into_exact  # noqa: E402

NBYTES = 64 << 20
MADV_POPULATE_WRITE = 23   # Linux 5.14+
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate_write(t: torch.Tensor) -> None:
    start = t.data_ptr() & ~(mmap.PAGESIZE - 1)
    if _libc.madvise(start, t.data_ptr() + t.nbytes - start, MADV_POPULATE_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")


def producer_main(q, stop) -> None:
    torch.set_num_threads(1)
    producer = make_producer("tcp")
    ref = producer.put(torch.randint(0, 256, (NBYTES,), dtype=torch.uint8))
    q.put({f: getattr(ref, f) for f in ref.__struct_fields__})
    stop.wait(600)
    producer.close()


def recv_chunked(sock: socket.socket, view: memoryview, chunk: int) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:], min(chunk, len(view) - got))
        if k == 0:
            raise ConnectionError("producer closed")
        got += k


def variants(ref: TensorRef):
    sock = connect(ref.endpoint, None, 30)
    socks = {}
    for mib in (1, 2, 4, 8):
        socks[mib] = connect(ref.endpoint, None, 30)
        socks[mib].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, mib << 20)
    pooled, fresh = make_consumer("tcp"), make_consumer("tcp", pool_bytes=0)
    reused = torch.zeros(NBYTES, dtype=torch.uint8)
    for c in (pooled, fresh):   # every variant on the same warm connection (a private hook, benchmark only)
        c._give(ref.endpoint, sock)

    def into(out, s=sock, chunk=None):
        request(s, ref)
        if chunk:
            recv_chunked(s, as_memoryview(out) if isinstance(out, torch.Tensor) else memoryview(out), chunk)
        else:
            recv_into_exact(s, as_memoryview(out) if isinstance(out, torch.Tensor) else memoryview(out))
        return out

    def fresh_populate():
        out = torch.empty(NBYTES, dtype=torch.uint8)
        populate_write(out)
        return into(out)

    def fresh_mmap():
        return into(mmap.mmap(-1, NBYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE))

    runs = {"get, pooled": lambda: pooled.get(ref), "get, fresh": lambda: fresh.get(ref),
            "fresh + POPULATE_WRITE": fresh_populate, "fresh MAP_POPULATE": fresh_mmap,
            "reused, chunk 1 MiB": lambda: into(reused, chunk=1 << 20),
            "reused, chunk 4 MiB": lambda: into(reused, chunk=4 << 20),
            "reused, whole": lambda: into(reused)}
    for mib, s in socks.items():
        runs[f"reused, RCVBUF {mib}M"] = lambda s=s: into(reused, s=s)

    def close():
        pooled.close()
        fresh.close()
        sock.close()
        for s in socks.values():
            s.close()
    return runs, close


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, help="rounds (--quick 7, --full 21)")
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="the default: a short run")
    length.add_argument("--full", action="store_true", help="more rounds")
    ap.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    args = ap.parse_args()
    args.rounds = (21 if args.full else 7) if args.rounds is None else args.rounds
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    torch.set_num_threads(1)
    load, wall0 = [os.getloadavg()[0]], time.perf_counter()
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=producer_main, args=(q, stop), daemon=True)
    proc.start()
    try:
        ref = TensorRef(**q.get(timeout=60))
        runs, close = variants(ref)
        gbps: dict[str, list[float]] = {k: [] for k in runs}
        # iperf-style before and after, not between rounds: it forks, and after a fork every page of
        # a reused buffer faults once more on its next write (copy-on-write), which skews the reused ones
        iperf = [iperf_loopback(128 << 20, repeats=1) for _ in range(3)]
        iperf64 = [iperf_loopback(128 << 20, repeats=1, chunk=NBYTES) for _ in range(3)]
        try:
            names = list(runs)
            for i in range(args.rounds):
                for name in names[i % len(names):] + names[:i % len(names)]:   # rotate: no variant always first
                    fn = runs[name]
                    t0 = time.perf_counter()
                    out = fn()
                    gbps[name].append(NBYTES / (time.perf_counter() - t0) / 1e9)
                    del out
        finally:
            close()
        iperf += [iperf_loopback(128 << 20, repeats=1) for _ in range(3)]
        iperf64 += [iperf_loopback(128 << 20, repeats=1, chunk=NBYTES) for _ in range(3)]
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    load.append(os.getloadavg()[0])
    seconds = round(time.perf_counter() - wall0, 1)
    ip = sorted(iperf)[len(iperf) // 2]
    rows = [{"variant": k, "gbps_p50": round(sorted(v)[len(v) // 2], 3), "gbps_best": round(max(v), 3),
             "vs_iperf": round(sorted(v)[len(v) // 2] / ip, 3)} for k, v in gbps.items()]
    ip64 = sorted(iperf64)[len(iperf64) // 2]
    if args.json:
        print(json.dumps({"load": load, "bytes": NBYTES, "rounds": args.rounds, "iperf_gbps_p50": round(ip, 3),
                          "iperf_64mib_buffers_gbps_p50": round(ip64, 3),
                          "rows": rows, "seconds": seconds}))
        return
    print(f"64 MiB over one tcp connection, {args.rounds} rounds; load average before/after "
          f"{load[0]:.2f} / {load[1]:.2f} (2 shared cores)\n")
    print(f"{'variant':<24} {'GB/s p50':>9} {'best':>7} {'x iperf':>8}")
    for r in rows:
        print(f"{r['variant']:<24} {r['gbps_p50']:>9.2f} {r['gbps_best']:>7.2f} {r['vs_iperf']:>8.2f}")
    print(f"{'iperf-style (16 MiB buf)':<24} {ip:>9.2f} {max(iperf):>7.2f} {1.0:>8.2f}")
    print(f"{'iperf-style, 64 MiB bufs':<24} {ip64:>9.2f} {max(iperf64):>7.2f} {ip64 / ip:>8.2f}")
    print(f"{seconds} s, load average {load[0]:.2f} -> {load[1]:.2f}")


if __name__ == "__main__":
    main()
