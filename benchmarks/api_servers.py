"""`--api-server-count 1` vs `2` (and more with --full) on the same pipeline and load.

Two workloads, each on new connections so the kernel spreads them over the frontends:
- chat: long prompts (tokenized and chat-templated in the frontend) with 2 output tokens,
  non-streaming. The thinker's prefill is in it too, so it shows what a pipeline gains.
- tokenize: vLLM's /tokenize on long chat messages: frontend work only, CPU-bound, so it
  shows what a second frontend process buys when the frontend is the bottleneck.
For each count: one cold run (first requests after start-up) and then `--repeats` warm
runs, kept apart. Prints throughput, end-to-end latency, queue delays, and per-frontend
CPU seconds and request counts (from each frontend's /metrics), with throughput ratios
against one frontend.

    .venv/bin/python benchmarks/api_servers.py          # --quick
    .venv/bin/python benchmarks/api_servers.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve import MODEL  # noqa: E402
from benchmarks.stats import pct  # noqa: E402

WORDS = ("omni serves multi stage pipelines across processes and hosts with shared memory tensors "
         "and a grpc master that holds the topology ").split()


def long_prompt(i: int, words: int) -> str:
    body = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))
    return f"Summarise in three words: {body}"


def per_frontend(metrics_text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        m = re.match(r'^omni_api_requests_total\{frontend="([^"]+)",route="/tokenize"[^}]*\} (\S+)', line)
        if m:
            # the api metrics name frontends by index; the pipeline ones by id: keep both apart
            d = out.setdefault(f"api{m.group(1)}", {"cpu_s": 0.0, "requests": 0.0})
            d["tokenize"] = d.get("tokenize", 0.0) + float(m.group(2))
        m = re.match(r'^(omni_frontend_cpu_seconds_total|omni_pipeline_requests_total)\{frontend="([^"]+)"[^}]*\} (\S+)', line)
        if m:
            name, fe, value = m.groups()
            d = out.setdefault(fe, {"cpu_s": 0.0, "requests": 0.0})
            d["cpu_s" if name.startswith("omni_frontend_cpu") else "requests"] += float(value)
        m = re.match(r'^omni_stage_(queue|output_queue)_seconds_(sum|count)\{frontend="([^"]+)"[^}]*\} (\S+)', line)
        if m:
            kind, agg, fe, value = m.groups()
            d = out.setdefault(fe, {"cpu_s": 0.0, "requests": 0.0})
            d[f"{kind}_{agg}"] = d.get(f"{kind}_{agg}", 0.0) + float(value)
    return out


async def scrape_all(url: str, count: int, tries: int = 200) -> dict[str, dict[str, float]]:
    """Each frontend's own /metrics, reached on new connections until all answered."""
    seen: dict[str, dict[str, float]] = {}
    for _ in range(tries):
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.get(f"{url}/metrics")
        fe = r.headers.get("x-omni-frontend")
        if fe not in seen:
            seen[fe] = per_frontend(r.text)
        if len(seen) == count:
            break
    merged: dict[str, dict[str, float]] = {}
    for d in seen.values():
        merged.update(d)
    return merged


async def run_load(url: str, concurrency: int, requests: int, words: int, workload: str = "chat") -> dict:
    sem = asyncio.Semaphore(concurrency)
    e2e: list[float] = []
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        messages = [{"role": "user", "content": long_prompt(i, words)}]
        if workload == "chat":
            path, body = "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                  "temperature": 0}
        else:
            path, body = "/tokenize", {"model": MODEL, "messages": messages}
        async with sem:
            t0 = time.perf_counter()
            r = await client.post(f"{url}{path}", json=body)
            if r.status_code != 200:
                errors += 1
            e2e.append(time.perf_counter() - t0)

    # No keep-alive: a new connection per request (the kernel picks a frontend each time),
    # but one client, so the load generator's own CPU stays small.
    client = httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_keepalive_connections=0))
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        await client.aclose()
    wall = time.perf_counter() - t0
    return {"requests": requests, "errors": errors, "requests_s": requests / wall,
            "client_cpu_share": (time.process_time() - cpu0) / wall,
            "e2e_p50_ms": pct(e2e, 0.5) * 1e3, "e2e_p99_ms": pct(e2e, 0.99) * 1e3}


def measure(count: int, args) -> dict:
    from tests.e2e.harness import OmniProcess

    p = OmniProcess("serve", MODEL, "--port", "0", "--api-server-count", str(count))
    try:
        url = p.http(600)
        before = asyncio.run(scrape_all(url, count))
        cold = asyncio.run(run_load(url, args.concurrency, args.concurrency, args.words))
        warm = [asyncio.run(run_load(url, args.concurrency, args.requests, args.words))
                for _ in range(args.repeats)]
        tok_cold = asyncio.run(run_load(url, args.tok_concurrency, args.tok_concurrency, args.tok_words, "tokenize"))
        tok = [asyncio.run(run_load(url, args.tok_concurrency, args.tok_requests, args.tok_words, "tokenize"))
               for _ in range(args.repeats + 1)]
        after = asyncio.run(scrape_all(url, count))
    finally:
        p.interrupt(60)
    frontends = {}
    for fe, d in after.items():
        b = before.get(fe, {})
        n = d.get("requests", 0) - b.get("requests", 0)
        qn = d.get("queue_count", 0) - b.get("queue_count", 0)
        on = d.get("output_queue_count", 0) - b.get("output_queue_count", 0)
        frontends[fe] = {
            "cpu_s": d.get("cpu_s", 0) - b.get("cpu_s", 0),
            "requests": n,
            "input_queue_ms": (d.get("queue_sum", 0) - b.get("queue_sum", 0)) / qn * 1e3 if qn else None,
            "output_queue_ms": (d.get("output_queue_sum", 0) - b.get("output_queue_sum", 0)) / on * 1e3 if on else None,
        }
    return {
        "api_server_count": count,
        "cold": cold,
        "warm_requests_s": [w["requests_s"] for w in warm],
        "warm_requests_s_median": statistics.median(w["requests_s"] for w in warm),
        "warm_e2e_p50_ms": statistics.median(w["e2e_p50_ms"] for w in warm),
        "warm_e2e_p99_ms": max(w["e2e_p99_ms"] for w in warm),
        "errors": cold["errors"] + sum(w["errors"] for w in warm),
        "frontends": frontends,
        "tokenize": {
            "cold_requests_s": tok_cold["requests_s"],
            "warm_requests_s": [w["requests_s"] for w in tok],
            "warm_requests_s_median": statistics.median(w["requests_s"] for w in tok),
            "warm_e2e_p50_ms": statistics.median(w["e2e_p50_ms"] for w in tok),
            "client_cpu_share": statistics.median(w["client_cpu_share"] for w in tok),
            "errors": tok_cold["errors"] + sum(w["errors"] for w in tok),
            "requests_by_frontend": {fe: d["tokenize"] - before.get(fe, {}).get("tokenize", 0.0)
                                     for fe, d in after.items() if "tokenize" in d},
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", default=True)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--words", type=int, default=200, help="prompt length in words")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tok-words", type=int, default=4000, help="/tokenize message length in words")
    ap.add_argument("--tok-concurrency", type=int, default=8)
    a = ap.parse_args()
    t0 = time.perf_counter()
    a.tok_requests = 1000 if a.full else 300
    a.requests = 48 if a.full else 8
    a.repeats = 3 if a.full else 2
    counts = [1, 2, 4] if a.full else [1, 2]
    rows = [measure(c, a) for c in counts]
    base = rows[0]["warm_requests_s_median"] or float("nan")
    tok_base = rows[0]["tokenize"]["warm_requests_s_median"] or float("nan")
    for r in rows:
        r["throughput_ratio_vs_1"] = r["warm_requests_s_median"] / base
        r["tokenize"]["throughput_ratio_vs_1"] = r["tokenize"]["warm_requests_s_median"] / tok_base
    seconds = round(time.perf_counter() - t0, 1)
    load = [round(x, 2) for x in os.getloadavg()]
    if a.json:
        print(json.dumps({"rows": rows, "seconds": seconds, "loadavg_end": load}))
        return
    print(f"chat, {a.words}-word prompts, 2 output tokens, concurrency {a.concurrency}, "
          f"{a.requests} requests x {a.repeats} warm runs (cold run kept apart)")
    print(f"{'frontends':>9} {'cold req/s':>10} {'warm req/s':>10} {'ratio':>6} {'e2e p50':>9} {'e2e p99':>9} {'errors':>6}")
    for r in rows:
        print(f"{r['api_server_count']:>9} {r['cold']['requests_s']:>10.2f} {r['warm_requests_s_median']:>10.2f} "
              f"{r['throughput_ratio_vs_1']:>6.2f} {r['warm_e2e_p50_ms']:>7.0f}ms {r['warm_e2e_p99_ms']:>7.0f}ms "
              f"{r['errors']:>6}")
    print(f"\n/tokenize, {a.tok_words}-word chat messages, concurrency {a.tok_concurrency}, "
          f"{a.tok_requests} requests x {a.repeats + 1} warm runs")
    print(f"{'frontends':>9} {'cold req/s':>10} {'warm req/s':>10} {'ratio':>6} {'e2e p50':>9} {'errors':>6} "
          f"{'client cpu':>10}  per frontend")
    for r in rows:
        t = r["tokenize"]
        spread = " ".join(f"{fe}={n:.0f}" for fe, n in sorted(t["requests_by_frontend"].items()))
        print(f"{r['api_server_count']:>9} {t['cold_requests_s']:>10.1f} {t['warm_requests_s_median']:>10.1f} "
              f"{t['throughput_ratio_vs_1']:>6.2f} {t['warm_e2e_p50_ms']:>7.0f}ms {t['errors']:>6} "
              f"{t['client_cpu_share']:>9.0%}  {spread}")
    print(f"\n{'frontends':>9} {'frontend':>12} {'cpu s':>7} {'requests':>8} {'in-queue':>9} {'out-queue':>9}")
    for r in rows:
        for fe, d in sorted(r["frontends"].items()):
            if fe.startswith("api"):
                continue
            iq = f"{d['input_queue_ms']:.2f}ms" if d["input_queue_ms"] is not None else "-"
            oq = f"{d['output_queue_ms']:.2f}ms" if d["output_queue_ms"] is not None else "-"
            print(f"{r['api_server_count']:>9} {fe:>12} {d['cpu_s']:>7.2f} {d['requests']:>8.0f} {iq:>9} {oq:>9}")
    print(f"\ntotal wall time {seconds} s, load average {load} at the end")


if __name__ == "__main__":
    main()
