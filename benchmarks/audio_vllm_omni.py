"""Streaming chat with audio as vllm-omni's benchmark client measures it, beside omni's /metrics.

The requests are benchmarks/audio.py's chat prompts (greedy, --max-tokens thinker tokens,
`modalities: ["text", "audio"]`), sent in the format of `vllm bench serve --omni --backend
openai-chat-omni` and parsed as that backend parses the stream (benchmarks/omni_chat_client.py):
per request the time to first audio (TTFA, its `audio_ttfp`), the audio's duration from the WAV
chunks and RTF = time to the last audio chunk / duration. At concurrency 1, 4 and 16 (vllm bench's
`--max-concurrency`: that many requests in flight, the next sent when one ends) the client's TTFA
p50/p99 and mean, RTF mean and audio seconds per second of wall time are printed beside the same
figures from /metrics (`vllm_omni:audio_ttfp_s`, `vllm_omni:audio_rtf`, `vllm_omni:audio_duration_s`:
the differences of their sums and counts over the level, so means, not percentiles). The two sides
must agree within 5% (`agree`): the server times a chunk when it hands it to the response, the
client when it has parsed it.

    .venv/bin/python benchmarks/audio_vllm_omni.py            # --quick: under 2 minutes
    .venv/bin/python benchmarks/audio_vllm_omni.py --full     # more requests per level
    .venv/bin/python benchmarks/audio_vllm_omni.py --json     # one JSON document
    .venv/bin/python benchmarks/audio_vllm_omni.py --url http://127.0.0.1:8091
"""

from __future__ import annotations

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

from benchmarks import audio  # noqa: E402
from benchmarks import omni_chat_client as oc  # noqa: E402
from benchmarks.audio import CHAT_PROMPTS, MODEL, start_server  # noqa: E402

TOLERANCE = 0.05
FAMILIES = ("vllm_omni:audio_ttfp_s", "vllm_omni:audio_rtf", "vllm_omni:audio_duration_s")


def scrape(text: str) -> dict[str, float]:
    """The families' _sum and _count, summed over their label sets (frontends, voices)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+?)_(sum|count)(?:\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in FAMILIES:
            key = f"{m.group(1)}_{m.group(2)}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile, as vllm bench reports them (numpy's default interpolation aside)."""
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def row(level: int, results: list[oc.Result], wall: float, delta: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok and r.audio_duration > 0]
    ttfa = [r.audio_ttfp for r in ok]
    audio_s = sum(r.audio_duration for r in ok)
    n_ttfa, n_dur = delta.get("vllm_omni:audio_ttfp_s_count", 0), delta.get("vllm_omni:audio_rtf_count", 0)
    server_ttfa = delta.get("vllm_omni:audio_ttfp_s_sum", 0) / n_ttfa if n_ttfa else None
    server_rtf = delta.get("vllm_omni:audio_rtf_sum", 0) / n_dur if n_dur else None
    server_audio = delta.get("vllm_omni:audio_duration_s_sum", 0.0)
    d = {
        "concurrency": level, "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttfa_ms_p50": round(1000 * pct(ttfa, 50), 1) if ttfa else None,
        "ttfa_ms_p99": round(1000 * pct(ttfa, 99), 1) if ttfa else None,
        "ttfa_ms_mean": round(1000 * statistics.mean(ttfa), 1) if ttfa else None,
        "rtf_mean": round(statistics.mean(r.audio_rtf for r in ok), 4) if ok else None,
        "audio_s": round(audio_s, 3), "audio_s_per_s": round(audio_s / wall, 4), "wall_s": round(wall, 2),
        "server_ttfa_count": int(n_ttfa), "server_ttfa_ms_mean": round(1000 * server_ttfa, 1) if server_ttfa else None,
        "server_rtf_mean": round(server_rtf, 4) if server_rtf else None,
        "server_audio_s": round(server_audio, 3), "server_audio_s_per_s": round(server_audio / wall, 4),
    }
    d["ratios"] = {"ttfa_mean": ratio(d["ttfa_ms_mean"], d["server_ttfa_ms_mean"]),
                   "rtf_mean": ratio(d["rtf_mean"], d["server_rtf_mean"]),
                   "audio_s_per_s": ratio(d["audio_s_per_s"], d["server_audio_s_per_s"])}
    d["agree"] = (not d["failed"] and n_ttfa == len(ok)
                  and all(v is not None and abs(v - 1) <= TOLERANCE for v in d["ratios"].values()))
    return d


async def metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    return scrape((await client.get(f"{url}/metrics")).text)


async def level(client: httpx.AsyncClient, url: str, concurrency: int, n: int, max_tokens: int) -> dict:
    before = await metrics(client, url)
    sem = asyncio.Semaphore(concurrency)
    extra = {"modalities": ["text", "audio"]}

    async def one(i: int) -> oc.Result:
        async with sem:
            body = oc.payload(MODEL, CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_tokens, extra)
            return await oc.chat(client, f"{url}/v1/chat/completions", body)

    t0 = time.perf_counter()
    results = list(await asyncio.gather(*(one(i) for i in range(n))))
    wall = time.perf_counter() - t0
    # Several frontends publish every 2 s: wait (bounded) until /metrics has every request.
    want = before.get("vllm_omni:audio_rtf_count", 0) + sum(r.ok and r.audio_duration > 0 for r in results)
    deadline = time.monotonic() + 10
    after = await metrics(client, url)
    while after.get("vllm_omni:audio_rtf_count", 0) < want and time.monotonic() < deadline:
        await asyncio.sleep(0.25)      # polling another process's published figures, bounded
        after = await metrics(client, url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return row(concurrency, results, wall, delta)


async def measure(url: str, levels: list[tuple[int, int]], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        await level(client, url, 1, 1, max_tokens)          # warm-up, not reported
        return [await level(client, url, c, n, max_tokens) for c, n in levels]


COLS = [("concurrency", "conc"), ("requests", "reqs"), ("ttfa_ms_p50", "TTFA p50"), ("ttfa_ms_p99", "p99"),
        ("ttfa_ms_mean", "mean"), ("server_ttfa_ms_mean", "srv mean"), ("rtf_mean", "RTF"),
        ("server_rtf_mean", "srv RTF"), ("audio_s_per_s", "audio s/s"), ("server_audio_s_per_s", "srv s/s"),
        ("agree", "agree")]


def table(rows: list[dict]) -> str:
    return audio.table(rows, [k for k, _ in COLS], [h for _, h in COLS])


def main() -> None:
    ap = audio.served_bench_args(__doc__)
    ap.add_argument("--max-tokens", type=int, default=32, help="thinker tokens per request")
    a = ap.parse_args()
    if a.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    levels = [(1, 8), (4, 16), (16, 48)] if a.full else [(1, 3), (4, 8), (16, 16)]
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    proc = None if a.url else start_server(None)
    try:
        url = a.url or proc.http(600)
        startup = round(time.perf_counter() - t0, 1)
        rows = asyncio.run(measure(url, levels, a.max_tokens))
    finally:
        if proc is not None:
            proc.interrupt(60)
    doc = {"model": MODEL, "client": "vllm-omni openai-chat-omni format (benchmarks/omni_chat_client.py)",
           "max_tokens": a.max_tokens, "tolerance": TOLERANCE, "startup_seconds": startup, "rows": rows,
           "all_agree": all(r["agree"] for r in rows), "loadavg_start": load_start,
           "loadavg_end": [round(x, 2) for x in os.getloadavg()], "seconds": round(time.perf_counter() - t0, 1)}
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{MODEL}: streaming chat with audio in vllm-omni's client format, {a.max_tokens} thinker tokens; "
          f"client figures beside /metrics' (srv) for the same requests; load {load_start} at the start")
    print(table(rows))
    for r in rows:
        if r["errors"]:
            print(f"concurrency {r['concurrency']}: {r['failed']} failed: {r['errors']}")
    verdict = "agree" if doc["all_agree"] else "do NOT all agree"
    print(f"client and /metrics {verdict} within {TOLERANCE:.0%} (TTFA mean, RTF mean, audio s/s); ratios "
          + "; ".join(f"c{r['concurrency']} {r['ratios']}" for r in rows))
    print(f"start-up {doc['startup_seconds']} s; total wall time {doc['seconds']} s; load {doc['loadavg_end']} at the end")


if __name__ == "__main__":
    main()
