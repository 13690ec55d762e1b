"""The Qwen3-Omni talker's MoE block, formulation by formulation (omni/models/qwen3_omni/moe.py), against
transformers' own block: time per call and max |difference| (float32, one thread), at the tiny test
model's size (4 experts, top 2) and the released size (128 experts, top 6, hidden 1024), for 1 to 64
rows (a decode step's batch). vLLM's CPU fused-MoE kernel is measured too where it imports.

    .venv/bin/python benchmarks/qwen3_moe.py [--quick | --full] [--rows 1,4,16,64] [--no-vllm] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni.models.qwen3_omni.moe import IMPLS, Moe  # noqa: E402

SIZES = {"tiny": dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
         "real": dict(hidden_size=1024, moe_intermediate_size=384, num_experts=128, num_experts_per_tok=6,
                      shared_expert_intermediate_size=768, norm_topk_prob=True)}


def block(size: str):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerTextSparseMoeBlock

    torch.manual_seed(0)
    b = Qwen3OmniMoeTalkerTextSparseMoeBlock(Qwen3OmniMoeTalkerTextConfig(**SIZES[size], hidden_act="silu"))
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0.0, 0.02)
    return b.eval().requires_grad_(False)


def timed(fn, budget_s: float) -> float:
    """Median microseconds per call over ~budget_s."""
    fn()
    times = []
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def vllm_cpu(b):
    """vLLM's CPU fused MoE (`torch.ops._C.cpu_fused_moe`, weights prepacked for the 'vec' ISA) as a
    callable x -> routed experts' output, or the reason it cannot run."""
    try:
        from vllm import _custom_ops as ops
    except Exception as e:        # noqa: BLE001 - any import failure is the answer
        return f"vllm does not import: {type(e).__name__}: {e}"[:200]
    try:
        w13 = ops.cpu_prepack_moe_weight(b.experts.gate_up_proj.contiguous(), "vec")
        w2 = ops.cpu_prepack_moe_weight(b.experts.down_proj.contiguous(), "vec")
    except Exception as e:        # noqa: BLE001
        return f"cpu_prepack_moe_weight: {type(e).__name__}: {e}"[:200]

    def routed(x, weights, experts):
        out = torch.empty_like(x)
        ops.cpu_fused_moe(out, x, w13, w2, None, None, weights.float().contiguous(), experts.int().contiguous(),
                          "silu", "vec")
        return out
    return routed


@torch.no_grad()
def measure(b, size: str, n: int, fused, budget: float) -> dict:
    x = torch.randn(n, SIZES[size]["hidden_size"], generator=torch.Generator().manual_seed(n))
    want = b(x[None])[0]
    row = {"size": size, "rows": n, "transformers_us": round(timed(lambda: b(x[None]), budget), 1)}
    for impl in IMPLS:
        if impl == "dense" and size == "real" and n > 4:
            continue          # every expert on every row: seconds a call at this size
        m = Moe.from_block(b, impl)
        row[f"{impl}_us"] = round(timed(lambda m=m: m(x), budget), 1)
        row[f"{impl}_max_diff"] = float((m(x) - want).abs().max())
    if callable(fused):       # routed experts only (timed with the routing), then the whole block's diff
        m = Moe.from_block(b, "grouped")
        try:
            row["vllm_cpu_us"] = round(timed(lambda: fused(x, *m.route(x)), budget), 1)
            row["vllm_cpu_max_diff"] = float((m.shared_out(x) + fused(x, *m.route(x)) - want).abs().max())
        except Exception as e:     # noqa: BLE001
            row["vllm_cpu"] = f"{type(e).__name__}: {e}"[:200]
    elif fused is not None:
        row["vllm_cpu"] = fused
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's kernel (its import takes seconds)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="the default: ~0.6 s of calls per figure (< 2 min)")
    length.add_argument("--full", action="store_true", help="~3 s of calls per figure")
    args = ap.parse_args()
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if min(rows_list) < 1:
        ap.error("every --rows entry must be >= 1")
    budget = 3.0 if args.full else 0.6
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    load = [round(x, 2) for x in os.getloadavg()]
    out = []
    for size in SIZES:
        b = block(size)
        fused = None if args.no_vllm else vllm_cpu(b)
        out += [measure(b, size, n, fused, budget) for n in rows_list]
    doc = {"rows": out, "seconds": round(time.perf_counter() - t0, 1), "loadavg_start": load,
           "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    for r in out:
        cells = [f"{k.removesuffix('_us')} {v:.0f} us" for k, v in r.items() if k.endswith("_us")]
        diffs = [f"{k.removesuffix('_max_diff')} {v:.1e}" for k, v in r.items() if k.endswith("_max_diff")]
        print(f"{r['size']:4} rows {r['rows']:>3}: " + ", ".join(cells) + " | max|diff| " + ", ".join(diffs)
              + (f" | vLLM: {r['vllm_cpu']}" if "vllm_cpu" in r else ""))
    print(f"{doc['seconds']} s, load average {doc['loadavg_start']} -> {doc['loadavg_end']}")


if __name__ == "__main__":
    main()
