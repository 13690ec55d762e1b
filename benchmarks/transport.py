"""Tensor transports side by side: memcpy, shm, tcp and gloo, 4 KiB .. 64 MiB, with the goals.

Producer and consumer are two processes; a ref carrier links them: a ZMQ PAIR ipc socket
(msgpack), as refs travelled before, or omni's LocalChannel (unix SEQPACKET, same user +
token hello; omni/transport/local.py). One timed iteration, measured in the consumer:

    consumer --request(size, acks of the previous keys)--> producer
    producer: put(tensor)   shm: copy into the arena (staged: the tensor already lives in the
                            arena, from producer.empty(), so put copies nothing) | tcp/gloo: keep it
    producer --TensorRef--> consumer
    consumer: get(ref)      shm: header check + zero-copy view (bytes not touched)
                            tcp: recv_into a pooled buffer (1 MiB+) | gloo: process-group recv

so shm's number is "producer copy into shared memory + ref round trip + map", the
whole cost of handing a tensor over on one host. "stream" asks for several tensors at
once: the producer copies the next while the consumer takes the last (steady-state
bandwidth). memcpy is one thread's torch `copy_` into a preallocated buffer of the same
size, in the consumer, measured right after each size's run ("x memcpy" is that ratio,
so a load change mid-run moves both). GB/s = bytes / p50.

    .venv/bin/python benchmarks/transport.py           # --quick (default, < 2 min)
    .venv/bin/python benchmarks/transport.py --full
    .venv/bin/python benchmarks/transport.py --json    # one JSON document on stdout
    .venv/bin/python benchmarks/transport.py --device cuda   # cuda_ipc vs shm, CUDA tensors

`--device cuda` measures the hand-off of CUDA tensors between two processes on one GPU: cuda_ipc
(get returns a device tensor of the consumer's own, copied on the GPU) against shm (device -> host
arena -> device: the consumer's `to("cuda")` and a synchronize are in the time) at 4 KiB, 1 MiB,
16 MiB and 256 MiB; "x memcpy" is then against a device-to-device copy in one process. Without a
GPU it says so and runs the same rows on CPU tensors, cuda_ipc on its host-memory stand-in: what
that shows is the protocol's overhead (ref, slot table, copy out), not CUDA IPC.
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

from benchmarks import transport_candidates as cand  # noqa: E402
from omni import envs  # noqa: E402
from omni.transport.base import TensorRef  # noqa: E402
from omni.transport.factory import make_consumer, make_producer  # noqa: E402
from omni.transport.local import LocalListener, connect_local  # noqa: E402

# (label, transport, carrier, mode)
RUNS = [("shm/zmq", "shm", "zmq", "copy"), ("shm", "shm", "local", "copy"),
        ("shm staged", "shm", "local", "staged"), ("shm stream", "shm", "local", "stream"),
        ("tcp", "tcp", "local", "copy"), ("gloo", "gloo", "local", "copy")]
QUICK_SKIP = {"gloo"}   # seconds per run and no goal: --full only
QUICK = {4 << 10: 200, 64 << 10: 100, 1 << 20: 40, 16 << 20: 10, 64 << 20: 5}
FULL = {4 << 10: 2000, 16 << 10: 2000, 64 << 10: 1000, 256 << 10: 500, 1 << 20: 200,
        4 << 20: 80, 16 << 20: 40, 64 << 20: 15}
WARMUP = 3
ARENA = 160 << 20
DEVICE_SIZES = {4 << 10: 200, 1 << 20: 50, 16 << 20: 20, 256 << 20: 8}
DEVICE_ARENA = (256 << 20) + (4 << 10)    # one 256 MiB tensor and shm's slot header
GOAL_ROUNDTRIP_US = 50.0
GOAL_BW_RATIO = 0.8


ECHO, STOP = -2, -1


class Req(msgspec.Struct, frozen=True, array_like=True):
    nbytes: int                      # STOP, ECHO (answer with a dummy ref, no put), or a payload size
    acks: tuple[int, ...] = ()       # keys of earlier tensors, freed before the next put
    count: int = 1                   # tensors to put, each ref sent as soon as it is put
    staged: bool = False             # the payload lives in the arena already (producer.empty)


def stream_count(nbytes: int) -> int:
    return max(2, min(8, (ARENA // 2) // nbytes))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def row(transport: str, nbytes: int, samples_s: list[float], per: int = 1) -> dict:
    p50 = pct(samples_s, 0.5)
    return {"transport": transport, "bytes": nbytes, "p50_us": round(p50 / per * 1e6, 1),
            "p99_us": round(pct(samples_s, 0.99) / per * 1e6, 1), "gbps": round(nbytes * per / p50 / 1e9, 3)}


def settle(device: str) -> None:
    """Wait for the device's queued work, so a time covers it (nothing to wait for on CPU)."""
    if device != "cpu":
        torch.cuda.synchronize()


def memcpy_samples(nbytes: int, iters: int, device: str = "cpu") -> list[float]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    samples = []
    for i in range(iters + WARMUP):
        t0 = time.perf_counter()
        dst.copy_(src)
        settle(device)
        if i >= WARMUP:
            samples.append(time.perf_counter() - t0)
    return samples


def progress(r: dict) -> None:
    """A row on stderr as it is measured: a run cut off by a time limit still leaves its figures."""
    print(f"transport: {r['transport']} {human(r['bytes'])}: p50 {r['p50_us']} us, p99 {r['p99_us']} us, "
          f"{r['gbps']} GB/s" + (f" ({r['vs_memcpy']}x memcpy)" if "vs_memcpy" in r else ""),
          file=sys.stderr, flush=True)


def bench_memcpy(sizes: dict[int, int]) -> list[dict]:
    rows = []
    for nbytes, iters in sizes.items():
        rows.append(row("memcpy", nbytes, memcpy_samples(nbytes, iters)))
        progress(rows[-1])
    return rows


class Carrier:
    """send/recv of bytes over ZMQ PAIR or LocalChannel; `peer` connects from the producer."""

    def __init__(self, kind: str):
        self.kind, self.token = kind, secrets.token_hex(16)
        if kind == "zmq":
            self.addr = f"ipc://@omni-bench-{os.getpid()}-{secrets.token_hex(4)}"
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.PAIR)
            self._sock.setsockopt(zmq.RCVTIMEO, 60_000)
            self._sock.bind(self.addr)
        else:
            self._listener = LocalListener(token=self.token)
            self.addr = self._listener.name
            self._ch = None

    def send(self, data: bytes) -> None:
        if self.kind == "zmq":
            self._sock.send(data)
        else:
            if self._ch is None:
                self._ch = self._listener.accept(timeout=60)
            self._ch.send(data)

    def recv(self) -> bytes:
        return self._sock.recv() if self.kind == "zmq" else self._ch.recv(timeout=60)

    def close(self) -> None:
        if self.kind == "zmq":
            self._sock.close(linger=0)
            self._ctx.term()
        else:
            if self._ch is not None:
                self._ch.close()
            self._listener.close()

    @staticmethod
    def peer(kind: str, addr: str, token: str):
        if kind == "local":
            ch = connect_local(addr, token)
            return ch.send, ch.recv, ch.close
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.connect(addr)

        def close() -> None:
            sock.close(linger=0)
            ctx.term()
        return sock.send, sock.recv, close


def producer_main(kind: str, carrier: str, addr: str, token: str, sizes: list[int], device: str = "cpu",
                  opts: dict | None = None) -> None:
    torch.set_num_threads(1)
    if opts is None:
        opts = {"arena_bytes": ARENA} if kind == "shm" else {}
    producer = make_producer(kind, **opts)
    payloads = {n: torch.randint(0, 256, (n,), dtype=torch.uint8, device=device) for n in sizes}
    send, recv, close = Carrier.peer(carrier, addr, token)
    dec = msgspec.msgpack.Decoder(Req)
    enc = msgspec.msgpack.Encoder()
    echo = enc.encode(TensorRef(transport=kind, endpoint="-", key=0, dtype="uint8", shape=(0,), nbytes=0))
    try:
        while True:
            req = dec.decode(recv())
            if req.acks:
                producer.free(list(req.acks))
            if req.nbytes == STOP:
                break
            if req.nbytes == ECHO:
                send(echo)
                continue
            for _ in range(req.count):
                if req.staged:   # as if the stage had written its output into producer.empty()
                    ref = producer.put(producer.empty((req.nbytes,), torch.uint8, owner="bench"), owner="bench")
                else:
                    ref = producer.put(payloads[req.nbytes], owner="bench")
                send(enc.encode(ref))
    finally:
        close()
        producer.close()


def bench_transport(label: str, kind: str, carrier: str, mode: str, sizes: dict[int, int],
                    floors: dict[str, list[float]], device: str = "cpu", opts: dict | None = None) -> list[dict]:
    """`device`: where the producer's tensors are and the consumer wants them (a CPU tensor from
    shm is moved there, inside the time); `opts`: the producer's."""
    chan = Carrier(carrier)
    proc = mp.get_context("spawn").Process(target=producer_main, args=(kind, carrier, chan.addr, chan.token,
                                                                       list(sizes), device, opts), daemon=True)
    proc.start()
    consumer = make_consumer(kind)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(TensorRef)
    rows: list[dict] = []
    acks: tuple[int, ...] = ()
    try:
        floor = []
        for i in range(200 + WARMUP):  # the notification floor: the ref round trip alone
            t0 = time.perf_counter()
            chan.send(enc.encode(Req(ECHO)))
            dec.decode(chan.recv())
            if i >= WARMUP:
                floor.append(time.perf_counter() - t0)
        floors.setdefault(carrier, floor)
        for nbytes, iters in sizes.items():
            count = stream_count(nbytes) if mode == "stream" else 1
            if mode == "stream" and nbytes < 1 << 20:
                continue
            samples = []
            for i in range(max(3, iters // count) + WARMUP):
                t0 = time.perf_counter()
                chan.send(enc.encode(Req(nbytes, acks, count, mode == "staged")))
                keys = []
                for _ in range(count):
                    try:
                        ref = dec.decode(chan.recv())
                    except (zmq.Again, TimeoutError):
                        raise SystemExit(f"{label} producer did not answer within 60 s "
                                         f"(alive: {proc.is_alive()})") from None
                    tensor = consumer.get(ref)
                    if device != "cpu":
                        tensor = tensor.to(device)
                        settle(device)
                    assert tensor.numel() == nbytes
                    del tensor
                    keys.append(ref.key)
                dt = time.perf_counter() - t0
                acks = tuple(keys)
                if i >= WARMUP:
                    samples.append(dt)
            r = row(label, nbytes, samples, count)
            # the same size's memcpy, measured now: the ratio holds up when load changes mid-run
            r["memcpy_gbps"] = row("memcpy", nbytes, memcpy_samples(nbytes, max(3, iters // 2), device))["gbps"]
            r["vs_memcpy"] = round(r["gbps"] / r["memcpy_gbps"], 3)
            rows.append(r)
            progress(r)
        chan.send(enc.encode(Req(STOP, acks)))
        proc.join(timeout=30)
    finally:
        consumer.close()
        if proc.is_alive():
            proc.kill()
            proc.join()
        chan.close()
    return rows


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def goals(rows: list[dict], carriers: list[dict], iperf_gbps: float, sizes: list[int]) -> list[dict]:
    by = {(r["transport"], r["bytes"]): r for r in rows}
    small = min(sizes)
    out = [{"goal": f"shm hand-off of {human(small)} over LocalChannel, p50 round trip < {GOAL_ROUNDTRIP_US:.0f} us",
            "value": by[("shm", small)]["p50_us"], "target": GOAL_ROUNDTRIP_US,
            "met": by[("shm", small)]["p50_us"] < GOAL_ROUNDTRIP_US}]
    for c in carriers:
        out.append({"goal": f"small-message round trip < {GOAL_ROUNDTRIP_US:.0f} us: {c['carrier']}",
                    "value": c["p50_us"], "target": GOAL_ROUNDTRIP_US, "met": c["p50_us"] < GOAL_ROUNDTRIP_US})
    big = [n for n in sizes if n >= 1 << 20]
    for label in ("shm/zmq", "shm", "shm staged", "shm stream"):
        ratios = [by[(label, n)]["vs_memcpy"] for n in big]
        out.append({"goal": f"{label}: bandwidth >= {GOAL_BW_RATIO}x memcpy at every size from 1 MiB "
                            f"(worst of {', '.join(human(n) for n in big)})",
                    "value": round(min(ratios), 3), "target": GOAL_BW_RATIO, "met": min(ratios) >= GOAL_BW_RATIO,
                    "ratios": {human(n): round(r, 3) for n, r in zip(big, ratios)}})
    tcp = {human(n): round(by[("tcp", n)]["gbps"] / iperf_gbps, 3) for n in big}
    out.append({"goal": f"omni tcp >= {GOAL_BW_RATIO}x one iperf-style loopback stream ({iperf_gbps:.2f} GB/s) "
                        "at every size from 1 MiB", "value": min(tcp.values()), "target": GOAL_BW_RATIO,
                "met": min(tcp.values()) >= GOAL_BW_RATIO, "ratios": tcp})
    return out


def print_tables(by: dict[tuple[str, int], dict], sizes: list[int], labels: list[str]) -> None:
    for title, field, fmt in (("p50 us per tensor", "p50_us", "{:>13.1f}"), ("GB/s (bytes / p50)", "gbps", "{:>13.2f}"),
                              ("x memcpy (same time)", "vs_memcpy", "{:>13.2f}")):
        head = f"{title:<20}| " + " ".join(f"{k:>13}" for k in labels)
        print(head)
        print("-" * len(head))
        for n in sizes:
            cells = [fmt.format(by[(k, n)][field]) if field in by.get((k, n), {}) else f"{'-':>13}" for k in labels]
            print(f"{human(n):>20}| " + " ".join(cells))
        print()


def device_runs(cuda: bool) -> list[tuple[str, str, str, dict]]:
    """(label, transport, device, producer options) of --device cuda."""
    if cuda:
        return [("shm d-h-d", "shm", "cuda", {"arena_bytes": DEVICE_ARENA}),
                ("cuda_ipc", "cuda_ipc", "cuda", {"arena_bytes": DEVICE_ARENA})]
    return [("shm", "shm", "cpu", {"arena_bytes": DEVICE_ARENA}),
            ("cuda_ipc host", "cuda_ipc", "cpu", {"arena_bytes": DEVICE_ARENA, "memory": "host"})]


def bench_device(as_json: bool) -> None:
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else ""
    skipped = "" if cuda else ("CUDA rows skipped: torch sees no CUDA GPU here. The same rows follow on CPU "
                               "tensors, cuda_ipc on its host-memory stand-in: protocol overhead, not CUDA IPC.")
    if skipped and not as_json:
        print(skipped + "\n", flush=True)
    load = [os.getloadavg()[0]]
    floors: dict[str, list[float]] = {}
    runs = device_runs(cuda)
    rows: list[dict] = []
    for label, kind, device, opts in runs:
        print(f"running {label} ...", file=sys.stderr, flush=True)
        rows += bench_transport(label, kind, "local", "copy", DEVICE_SIZES, floors, device, opts)
    load.append(os.getloadavg()[0])
    if as_json:
        print(json.dumps({"device": "cuda" if cuda else "cpu", "gpu": gpu, "skipped": skipped, "load": load,
                          "rows": rows, "floors_p50_us": {c: round(pct(f, 0.5) * 1e6, 1) for c, f in floors.items()},
                          "seconds": round(time.perf_counter() - t0, 1)}))
        return
    print(f"two processes, refs over LocalChannel, {'on ' + gpu if cuda else 'CPU tensors'}; "
          f"load average before/after: {load[0]:.2f} / {load[1]:.2f}\n")
    print_tables({(r["transport"], r["bytes"]): r for r in rows}, list(DEVICE_SIZES), [r[0] for r in runs])
    print("ref round trip alone (no put/get): " + ", ".join(
        f"{c} p50 {pct(f, 0.5) * 1e6:.1f} us" for c, f in floors.items()))
    print(f"total wall time {time.perf_counter() - t0:.1f} s")


def print_report(rows: list[dict], sizes: list[int], carriers: list[dict], floors: dict[str, list[float]],
                 iperf_gbps: float, goal_rows: list[dict], load: list[float], run_labels: list[str]) -> None:
    labels = ["memcpy", *run_labels]
    by = {(r["transport"], r["bytes"]): r for r in rows}
    print("\n\n".join(__doc__.split("\n\n")[1:4]) + "\n")
    print(f"load average before/after: {load[0]:.2f} / {load[1]:.2f} (2 shared cores: figures are noisy)")
    print(f"LocalChannel ends poll up to OMNI_SPIN_US={envs.OMNI_SPIN_US} us before blocking (0: off)\n")
    print_tables(by, sizes, labels)
    print("ref round trip alone (no put/get): " + ", ".join(
        f"{c} p50 {pct(f, 0.5) * 1e6:.1f} us p99 {pct(f, 0.99) * 1e6:.1f} us" for c, f in floors.items()))
    print("\nsmall-message (128 B) round trip between two processes:")
    for c in carriers:
        print(f"  {c['carrier']:<55} p50 {c['p50_us']:>7.1f} us   p99 {c['p99_us']:>8.1f} us")
    print(f"\niperf-style single TCP stream over 127.0.0.1: {iperf_gbps:.2f} GB/s; omni tcp: " + ", ".join(
        f"{human(n)} {by[('tcp', n)]['gbps']:.2f} GB/s ({by[('tcp', n)]['gbps'] / iperf_gbps:.2f}x)"
        for n in sizes if n >= 1 << 20))
    print("\ngoals:")
    for g in goal_rows:
        extra = f"  {g['ratios']}" if "ratios" in g else ""
        print(f"  [{'met' if g['met'] else 'MISSED':>6}] {g['goal']}: {g['value']}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer iterations (default)")
    mode.add_argument("--full", action="store_true", help="more sizes and iterations")
    ap.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: only the CUDA-tensor rows, cuda_ipc vs shm (on CPU: their stand-in)")
    args = ap.parse_args()
    if args.device == "cuda":
        torch.set_num_threads(1)
        bench_device(args.json)
        return
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    sizes = FULL if args.full else QUICK
    load = [os.getloadavg()[0]]
    rows = bench_memcpy(sizes)
    floors: dict[str, list[float]] = {}
    runs = RUNS if args.full else [r for r in RUNS if r[0] not in QUICK_SKIP]
    for label, kind, carrier, run_mode in runs:
        print(f"running {label} ...", file=sys.stderr, flush=True)
        rows += bench_transport(label, kind, carrier, run_mode, sizes, floors)
    print("running carriers and iperf ...", file=sys.stderr, flush=True)
    carriers = cand.carrier_rows(2000 if args.full else 300)
    iperf_gbps = cand.iperf_loopback((1 << 30) if args.full else (128 << 20))
    touch = cand.first_touch(64 << 20)
    cpu = cand.shm_cpu_costs(list(sizes))
    load.append(os.getloadavg()[0])
    goal_rows = goals(rows, carriers, iperf_gbps, list(sizes))
    if args.json:
        print(json.dumps({"load": load, "spin_us": envs.OMNI_SPIN_US, "rows": rows, "carriers": carriers,
                          "iperf_gbps": round(iperf_gbps, 3),
                          "floors_p50_us": {c: round(pct(f, 0.5) * 1e6, 1) for c, f in floors.items()},
                          "first_touch": touch, "shm_cpu": cpu, "goals": goal_rows,
                          "seconds": round(time.perf_counter() - t0, 1)}))
    else:
        print_report(rows, list(sizes), carriers, floors, iperf_gbps, goal_rows, load, [r[0] for r in runs])
        print(f"\nfirst touch: put of {human(touch['bytes'])} into a fresh arena {touch['cold_us']:.0f} us, into the "
              f"same (faulted-in) slot again {touch['warm_us']:.0f} us: {touch['cold_over_warm']:.2f}x")
        print("\nshm CPU per hand-off (thread CPU time, one process; the part of the round trip load does not "
              "inflate):\n  " + ", ".join(f"{human(c['bytes'])} put+encode+free {c['put_cpu_us']:.1f} us, "
                                         f"staged {c['staged_put_cpu_us']:.1f} us, decode+get {c['get_cpu_us']:.1f} us"
                                         for c in cpu))
        print(f"\ntotal wall time {time.perf_counter() - t0:.1f} s, load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
