"""Offered load against the default pipeline served by `omni serve`.

Starts `omni serve MODEL --port 0` (or uses --url), sends streaming chat requests at
several concurrencies, and prints throughput (completion tokens from the usage chunk, as vLLM's
bench client counts them), TTFT (first text) and end-to-end p50/p99, plus the
time spent in omni outside the engines (from /metrics: end-to-end time minus the
engine step time of the outputs) per output, side by side with the engine's step time.

    .venv/bin/python benchmarks/serve.py            # --quick: concurrency 1 and 4
    .venv/bin/python benchmarks/serve.py --full     # 1, 2, 4, 8 and more requests
    .venv/bin/python benchmarks/serve.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stats import pct  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPTS = [
    "Write one sentence about the sea.",
    "Name three colours.",
    "What is two plus two?",
    "Say hello in French.",
]


def scrape(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(omni_pipeline_e2e_seconds_(?:sum|count)|omni_stage_step_seconds_(?:sum|count))\{([^}]*)\} (\S+)", line)
        if m:
            name, labels, value = m.groups()
            stage = re.search(r'stage="(\d+)"', labels)
            key = name + (f"[{stage.group(1)}]" if stage else "")
            out[key] = out.get(key, 0.0) + float(value)
    return out


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float | None, float, int]:
    """(TTFT: the first chunk with text, None without any; end to end; completion tokens). The tokens
    are the usage chunk's (stream_options.include_usage, as vLLM's bench client reads them): omni sends
    an empty chunk per token whose text it holds back, and a chunk may carry several tokens' text."""
    t0 = time.perf_counter()
    ttft = None
    tokens = None
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    if tokens is None:
        raise RuntimeError("the stream ended without a usage chunk (stream_options.include_usage)")
    return ttft, time.perf_counter() - t0, tokens


def ms(values: list[float], q: float) -> float | None:
    return pct(values, q) * 1e3 if values else None


def row(concurrency: int, results: list[tuple], wall: float, d: dict[str, float]) -> dict:
    """One concurrency level's figures from its requests' (TTFT, e2e, tokens) and the /metrics deltas."""
    outputs = d.get("omni_stage_step_seconds_count[0]", 0.0) or 1.0
    engine_s = d.get("omni_stage_step_seconds_sum[0]", 0.0)
    e2e_s = d.get("omni_pipeline_e2e_seconds_sum", 0.0)
    ttfts = [r[0] for r in results if r[0] is not None]
    e2es = [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    return {
        "concurrency": concurrency, "requests": len(results), "tokens": tokens,
        "throughput_tok_s": tokens / wall, "requests_s": len(results) / wall,
        "ttft_p50_ms": ms(ttfts, 0.5), "ttft_p99_ms": ms(ttfts, 0.99),
        "e2e_p50_ms": ms(e2es, 0.5), "e2e_p99_ms": ms(e2es, 0.99),
        "engine_step_ms": engine_s / outputs * 1e3,
        # At concurrency 1 each output waits on its own step, so the remainder is omni's.
        "omni_overhead_per_output_ms": max(0.0, (e2e_s - engine_s)) / outputs * 1e3 if concurrency == 1 else None,
    }


async def level(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        before = scrape((await client.get(f"{url}/metrics")).text)
        sem = asyncio.Semaphore(concurrency)
        results = []

        async def run(i: int) -> None:
            async with sem:
                results.append(await one(client, url, PROMPTS[i % len(PROMPTS)], max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(run(i) for i in range(requests)))
        wall = time.perf_counter() - t0
        after = scrape((await client.get(f"{url}/metrics")).text)
    return row(concurrency, results, wall, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})


def start_server() -> tuple[object, str]:
    from tests.e2e.harness import OmniProcess

    p = OmniProcess("serve", MODEL, "--port", "0")
    return p, p.http(600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="benchmark a running server instead of starting one")
    ap.add_argument("--quick", action="store_true", default=True)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    t0 = time.perf_counter()
    levels = [(1, 4), (4, 8)] if not a.full else [(1, 8), (2, 16), (4, 32), (8, 48)]
    proc = None
    url = a.url
    if url is None:
        proc, url = start_server()
    try:
        asyncio.run(level(url, 1, 1, 4))   # warm-up, not reported
        rows = [asyncio.run(level(url, c, n, a.max_tokens)) for c, n in levels]
    finally:
        if proc is not None:
            proc.interrupt(60)
    seconds = round(time.perf_counter() - t0, 1)
    load = [round(x, 2) for x in os.getloadavg()]
    if a.json:
        print(json.dumps({"rows": rows, "seconds": seconds, "loadavg_end": load}))
        return
    print(f"omni serve {MODEL}: streaming chat, {a.max_tokens} tokens per request")
    print(f"{'conc':>4} {'reqs':>4} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>9} {'e2e p99':>9} "
          f"{'engine step':>11} {'omni/output':>11}")
    for r in rows:
        ov = r["omni_overhead_per_output_ms"]
        t50, t99 = (f"{r[k]:>7.1f}ms" if r[k] is not None else f"{'-':>9}" for k in ("ttft_p50_ms", "ttft_p99_ms"))
        print(f"{r['concurrency']:>4} {r['requests']:>4} {r['throughput_tok_s']:>7.1f} {t50} "
              f"{t99} {r['e2e_p50_ms']:>7.0f}ms {r['e2e_p99_ms']:>7.0f}ms "
              f"{r['engine_step_ms']:>9.2f}ms {('%.2fms' % ov) if ov is not None else '-':>11}")
    print(f"total wall time {seconds} s, load average {load} at the end")


if __name__ == "__main__":
    main()
