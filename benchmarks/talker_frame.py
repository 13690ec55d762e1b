"""One talker frame taken apart: where a decode step's time goes (Qwen3-Omni or Qwen2.5-Omni talker).

Per batch size, the frame the CUDA graphs hold (talker step, code 0, for Qwen3 the 15 residual
codes, sampling and end detection, over the whole cache width):
  replayed ms   one graph replay (on a CPU: not there);
  launched ms   the same frame run op by op (the static step with enforce_eager);
  kernels       the GPU kernels one replay runs (torch.profiler), and `busy ms`, their summed time;
                also by kind (matmul, attention, sort, reduce, index, copy, elementwise: KINDS).
busy / replayed near 1: the GPU's own work bounds the frame (fewer bytes or FLOPs would help); well
below 1: the gaps between kernels do (fewer kernels would: fusion). The kernels that take the most
time are listed. The engine is built as the benchmarks' stage worker builds it (benchmarks/
qwen3_stages.py): `--real-size` for the released sizes with random weights in memory, else the tiny
model on the CPU (launched ms only; it runs in seconds).

    .venv/bin/python benchmarks/talker_frame.py [MODEL_DIR] [--model qwen3|qwen25] [--batch 1,16]
        [--quick | --full] [--frames 50] [--real-size] [--device cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import qwen3_stages  # noqa: E402


def per_frame_ms(fn, frames: int, device: str) -> float:
    for _ in range(3):
        fn()
    qwen3_stages._sync(device)
    t0 = time.perf_counter()
    for _ in range(frames):
        fn()
    qwen3_stages._sync(device)
    return (time.perf_counter() - t0) / frames * 1000


# Kernel kinds by name (CUDA's and torch's kernel names), first match wins: where a frame's kernels go
# says what to fuse (many small elementwise or index kernels) or what bounds it (matmul time).
KINDS = (("attention", ("fmha", "flash", "attention", "efficient")),
         ("matmul", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "grouped_mm", "splitk")),
         ("sort", ("sort", "radix")),
         ("reduce", ("reduce", "softmax", "scan", "cumsum", "norm")),
         ("index", ("index", "gather", "scatter", "embedding")),
         ("copy", ("copy", "memcpy", "memset", "fill")),
         ("elementwise", ("elementwise", "vectorized", "unrolled")))


def kind(kernel: str) -> str:
    low = kernel.lower()
    return next((name for name, keys in KINDS if any(k in low for k in keys)), "other")


def kernels(fn) -> tuple[int, float, list[dict], dict]:
    """One call of fn under torch.profiler -> (kernels, their summed GPU ms, the top 5 by time, count
    and ms per kind)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name].append(e.device_time / 1000)
    return (sum(len(t) for t in times.values()), sum(sum(t) for t in times.values()), top_kernels(times),
            by_kind(times))


def top_kernels(times: dict[str, list[float]], n: int = 5) -> list[dict]:
    top = sorted(times.items(), key=lambda kv: -sum(kv[1]))[:n]
    return [{"kernel": k[:70], "count": len(t), "ms": round(sum(t), 3)} for k, t in top]


def by_kind(times: dict[str, list[float]]) -> dict[str, dict]:
    kinds: dict[str, dict] = {}
    for name, t in times.items():
        k = kinds.setdefault(kind(name), {"count": 0, "ms": 0.0})
        k["count"] += len(t)
        k["ms"] += sum(t)
    return {k: {"count": v["count"], "ms": round(v["ms"], 3)}
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["count"])}


def measure(runner, b: int, frames: int, device: str) -> dict:
    dev = runner.dev
    dev.load_inputs([[0] * b for _ in range(dev.inputs.shape[0])])     # no row steps: the state stays
    row = {"batch": b, "launched_ms": round(per_frame_ms(lambda: dev.decode(b, dev.length, True, True), frames, device), 3)}
    if runner.graphs is None:
        return row
    replay = functools.partial(runner.graphs.run, b)
    row["replayed_ms"] = round(per_frame_ms(replay, frames, device), 3)
    if torch.backends.cuda.is_built():         # not on the emulator (tests/unit/fake_cuda.py): no kernels there
        n, busy, top, kinds = kernels(replay)
        row.update(kernels=n, busy_ms=round(busy, 3), busy_fraction=round(busy / row["replayed_ms"], 2), top=top,
                   by_kind=kinds)
    return row


def bench(source: qwen3_stages.Source, batches: list[int], frames: int) -> dict:
    runner = source.talker("graphed" if source.device.startswith("cuda") else "static", max(batches))._static
    rows = []
    with torch.no_grad():
        for b in batches:
            rows.append(measure(runner, b, frames, source.device))
            qwen3_stages.progress(json.dumps(rows[-1]), "talker_frame")
    graphs = runner.graphs
    return {"rows": rows, "capture_seconds": round(graphs.seconds, 2) if graphs is not None else None,
            "graph_sizes": graphs.sizes if graphs is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    qwen3_stages.source_args(ap)
    ap.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--frames", type=int, help="frames timed per batch size (--quick 50, --full 300)")
    args = ap.parse_args()
    args.frames = (300 if args.full else 50) if args.frames is None else args.frames
    try:
        batches = sorted({int(b) for b in args.batch.split(",")})
    except ValueError:
        ap.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    if min(batches) < 1 or args.frames < 1:
        ap.error("every --batch entry and --frames must be >= 1")
    qwen3_stages.check_source_args(ap, args)
    t0, load0 = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        doc = bench(qwen3_stages.open_source(args, tmp), batches, args.frames)
    doc.update({"model": args.model, "weights": qwen3_stages.weights(args), "device": args.device,
                "seconds": round(time.perf_counter() - t0, 1), "loadavg_start": load0,
                "loadavg_end": [round(x, 2) for x in os.getloadavg()]})
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{'batch':>5} {'launched ms':>11} {'replayed ms':>11} {'kernels':>7} {'busy ms':>8} {'busy/replayed':>13}")
    for r in doc["rows"]:
        cells = [f"{r[k]:>{w}}" if k in r else f"{'-':>{w}}"
                 for k, w in (("replayed_ms", 11), ("kernels", 7), ("busy_ms", 8), ("busy_fraction", 13))]
        print(f"{r['batch']:>5} {r['launched_ms']:>11} " + " ".join(cells))
        for t in r.get("top", []):
            print(f"      {t['ms']:>8.3f} ms {t['count']:>5}x {t['kernel']}")
        if "by_kind" in r:
            print("      by kind: " + ", ".join(f"{k} {v['count']}x {v['ms']} ms" for k, v in r["by_kind"].items()))
    if doc["capture_seconds"] is not None:
        print(f"CUDA graphs {doc['graph_sizes']} captured in {doc['capture_seconds']} s")
    print(f"{doc['model']}, {doc['weights']} weights, {doc['device']}; {doc['seconds']} s, "
          f"load average {doc['loadavg_start']} -> {doc['loadavg_end']}")


if __name__ == "__main__":
    main()
