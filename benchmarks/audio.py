"""Speech served by omni vs the same engines called in one process.

Time to first audio (TTFA) and real-time factor (RTF = seconds spent / seconds of
audio) at concurrency 1 and 4, for `/v1/audio/speech` and, unless --no-chat,
streaming chat with audio. The in-process rows come from
benchmarks/audio_reference.py (talker + code2wav stepped in one thread, same
texts, same chunking as the deployed code2wav), so the difference is omni's
overhead: processes, channels, shared-memory tensors, HTTP.

All sides run side by side: bursts of the concurrency level (the same texts), served
and in-process in turn, each side first in turn, so a change in the shared machine's load
hits all; warm-ups are not reported. Served speech is measured twice: `omni` with a
minimal HTTP/1.1 client (benchmarks/raw_http.py: what the server costs a client) and
`omni httpx` with httpx, the client of the `openai` package (~1.3 ms of its own per
request here, the `omni httpx - omni` row). Per level: TTFA p50 with p10/p90,
omni's p50 minus in-process p50, and the paired differences (same text, back to back).
Goal 4 (issue 18): speech TTFA at concurrency 1 within +10 ms of in-process, judged on the
paired differences' p50 (TTFA depends on the text's first sentence, so a p50 over a mix of
texts jumps between texts).
TTFA for speech is the client's time to the first body byte (`response_format: pcm`
streams as code2wav makes it; one kept-alive connection); `srv TTFA` is the
orchestrator's time to the first code2wav chunk (mean, from /metrics). Chat rows have
no in-process twin: they include the thinker; `1st sent` is when the client's text
first held a whole sentence (what the talker starts from) and `TTFA-sent` the time
from there to first audio: the audio stages' and the pipeline's own share.
`--trace DIR` has the server write OMNI_LATENCY_TRACE timestamps and prints each
hop of the first audio (benchmarks/latency_trace_report.py: speech_report).

    .venv/bin/python benchmarks/audio.py              # --quick, under 2 minutes
    .venv/bin/python benchmarks/audio.py --full       # more requests
    .venv/bin/python benchmarks/audio.py --json       # one JSON document
    .venv/bin/python benchmarks/audio.py --trace /tmp/t   # and where the first audio's time goes
    .venv/bin/python benchmarks/audio.py --first-chunk-frames 16   # and a 16-frame first chunk beside
    .venv/bin/python benchmarks/audio.py --url http://127.0.0.1:8091
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import statistics
import sys
import time
import types
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import audio_reference as ref  # noqa: E402
from benchmarks.raw_http import RawClient  # noqa: E402
from omni.models.piper.processors import SENTENCE_END  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RATE = 22050
CHAT_PROMPTS = [
    "Tell me about cats in two sentences.",
    "Describe the sea in two short sentences.",
    "Say two short sentences about trains.",
    "Tell me about the moon in two sentences.",
]


def code2wav_args(first_chunk_frames: int | None = None) -> types.SimpleNamespace:
    """The deployed code2wav's chunking (or with another first chunk), so the in-process
    reference decodes alike; `stage_id` is the code2wav stage's."""
    from omni import config

    cfg = config.load(MODEL)
    stage = next(s for s in cfg.stages if s.engine == "piper_code2wav")
    ea = stage.engine_args
    chunk = int(ea.get("chunk_frames", 64))
    return types.SimpleNamespace(chunk_frames=chunk,
                                 first_chunk_frames=first_chunk_frames or ea.get("first_chunk_frames") or chunk,
                                 context_frames=int(ea.get("context_frames", 16)), threads=int(ea.get("threads", 1)),
                                 stage_id=stage.stage_id)


class Reference:
    """The in-process twin: the same talker and code2wav engines, stepped in this process."""

    def __init__(self, args: types.SimpleNamespace):
        import torch

        from omni.models.piper.engines import Code2WavEngine, TalkerEngine
        from omni.models.piper.voice import prepare_voice

        torch.set_num_threads(1)
        voice = prepare_voice("joe")
        self.talker = TalkerEngine(voice, threads=args.threads)
        self.c2w = Code2WavEngine(voice, chunk_frames=args.chunk_frames, context_frames=args.context_frames,
                                  first_chunk_frames=args.first_chunk_frames, threads=args.threads)
        self.n = 0
        self.burst(["Warm up."])

    def burst(self, texts: list[str]) -> list[dict]:
        self.n += 1
        return ref.run_burst(self.talker, self.c2w, texts, f"b{self.n}")


def scrape_first_output(text: str) -> tuple[float, float]:
    total = count = 0.0
    for line in text.splitlines():
        m = re.match(r"^omni_pipeline_first_output_seconds_(sum|count)\{[^}]*\} (\S+)", line)
        if m:
            if m.group(1) == "sum":
                total += float(m.group(2))
            else:
                count += float(m.group(2))
    return total, count


async def one_speech(client: httpx.AsyncClient, url: str, text: str) -> dict:
    t0 = time.perf_counter()
    first = None
    n = 0
    body = {"model": MODEL, "input": text, "voice": "joe", "response_format": "pcm"}
    async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"speech: HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for chunk in r.aiter_raw():
            if chunk and first is None:
                first = time.perf_counter() - t0
            n += len(chunk)
    return {"first": first, "done": time.perf_counter() - t0, "samples": n // 2}


async def one_speech_raw(client: RawClient, text: str) -> dict:
    body = {"model": MODEL, "input": text, "voice": "joe", "response_format": "pcm"}
    r = await client.post_stream("/v1/audio/speech", body)
    return {"first": r["first"], "done": r["done"], "samples": r["bytes"] // 2}


async def one_chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = sentence = None
    text = ""
    n = 0
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "modalities": ["text", "audio"], "audio": {"voice": "joe"}}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat: HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"chat: {chunk['error']}")
            for c in chunk["choices"]:
                text += c["delta"].get("content") or ""
                # The talker starts on a sentence once its end is seen (omni.models.piper.processors.thinker_to_talker).
                if sentence is None and SENTENCE_END.search(text):
                    sentence = time.perf_counter() - t0
                data = (c["delta"].get("audio") or {}).get("data")
                if data:
                    if first is None:
                        first = time.perf_counter() - t0
                    n += len(base64.b64decode(data)) // 2
    done = time.perf_counter() - t0
    # No sentence end in the text: the talker got it all when the thinker finished.
    return {"first": first, "done": done, "samples": n, "sentence": sentence}


def spread(ms: list[float]) -> dict:
    """p50 and the spread of a list of milliseconds."""
    return {"p50": round(statistics.median(ms), 1), "p10": round(ref._pct(ms, 0.1), 1),
            "p90": round(ref._pct(ms, 0.9), 1), "min": round(min(ms), 1), "max": round(max(ms), 1)}


def speech_row(mode: str, level: int, recs: list[dict], wall: float, load: list[float],
               server_ttfa_ms: float | None = None) -> dict:
    audio_s = sum(r["samples"] for r in recs) / RATE
    ttfa = [1000 * r["first"] for r in recs if r["first"] is not None]
    s = spread(ttfa)
    return {
        "mode": mode, "route": "speech", "concurrency": level, "requests": len(recs),
        "ttfa_ms_p50": s["p50"], "ttfa_ms_p10": s["p10"], "ttfa_ms_p90": s["p90"],
        # omni: the orchestrator's mean time to the first code2wav chunk (from /metrics).
        "server_ttfa_ms_mean": server_ttfa_ms,
        "latency_ms_p50": round(1000 * statistics.median(r["done"] for r in recs), 1),
        "request_rtf_mean": round(statistics.mean(r["done"] / (r["samples"] / RATE) for r in recs
                                                  if r["samples"]), 4),
        "aggregate_rtf": round(wall / audio_s, 4) if audio_s else None,
        "audio_seconds": round(audio_s, 2), "load_1m": round(load[0], 2),
    }


def chat_row(level: int, recs: list[dict], wall: float, load: list[float]) -> dict:
    audio_s = sum(r["samples"] for r in recs) / RATE
    ttfa = [1000 * r["first"] for r in recs if r["first"] is not None]
    sentence = [1000 * r["sentence"] for r in recs if r.get("sentence") is not None]
    share = [1000 * (r["first"] - r["sentence"]) for r in recs
             if r.get("sentence") is not None and r["first"] is not None]
    return {
        "mode": "omni", "route": "chat", "concurrency": level, "requests": len(recs),
        "ttfa_ms_p50": round(statistics.median(ttfa), 1) if ttfa else None,
        "ttfa_ms_p10": round(ref._pct(ttfa, 0.1), 1) if ttfa else None,
        "ttfa_ms_p90": round(ref._pct(ttfa, 0.9), 1) if ttfa else None,
        # When the thinker's text held its first sentence (the talker's first input), and
        # first audio minus that: the audio stages' and the pipeline's own share of TTFA.
        "first_sentence_ms_p50": round(statistics.median(sentence), 1) if sentence else None,
        "audio_after_sentence_ms_p50": round(statistics.median(share), 1) if share else None,
        "latency_ms_p50": round(1000 * statistics.median(r["done"] for r in recs), 1),
        "request_rtf_mean": round(statistics.mean(r["done"] / (r["samples"] / RATE) for r in recs
                                                  if r["samples"]), 4) if any(r["samples"] for r in recs) else None,
        "aggregate_rtf": round(wall / audio_s, 4) if audio_s else None,
        "audio_seconds": round(audio_s, 2), "load_1m": round(load[0], 2),
    }


class Variant:
    """One code2wav chunking, served (`url`) and in process (`reference`)."""

    def __init__(self, label: str, args: types.SimpleNamespace, url: str, reference: Reference):
        self.label, self.args, self.url, self.reference = label, args, url, reference
        self.raw = RawClient(url)

    def names(self) -> tuple[str, str, str]:
        """Served with the minimal client (judged), served with httpx, in process."""
        return f"omni{self.label}", f"omni httpx{self.label}", f"in-process{self.label}"

    def sides(self, client: httpx.AsyncClient):
        async def served(texts):
            return list(await asyncio.gather(*[one_speech_raw(self.raw, t) for t in texts]))

        async def served_httpx(texts):
            return list(await asyncio.gather(*[one_speech(client, self.url, t) for t in texts]))

        async def local(texts):
            return self.reference.burst(texts)
        return list(zip(self.names(), (served, served_httpx, local)))


def compare(level: int, n_requests: int, a: dict, b: dict, ra: list[dict], rb: list[dict]) -> dict:
    """Side a minus side b: TTFA p50s, and the paired differences (same text, same burst)."""
    deltas = [1000 * (x["first"] - y["first"]) for x, y in zip(ra, rb)]
    return {"concurrency": level, "requests": n_requests, "a": a["mode"], "b": b["mode"],
            "ttfa_p50_delta_ms": round(a["ttfa_ms_p50"] - b["ttfa_ms_p50"], 1), "paired_delta_ms": spread(deltas)}


async def speech_side_by_side(client: httpx.AsyncClient, variants: list[Variant], level: int,
                              n_requests: int) -> tuple[list[dict], list[dict]]:
    """Bursts of `level` requests, every side in turn (the order rotating burst by burst), so a
    change in the machine's load hits all of them; the same texts on every side."""
    sides = [s for v in variants for s in v.sides(client)]
    before = {v.url: scrape_first_output((await client.get(f"{v.url}/metrics")).text) for v in variants}
    recs: dict[str, list[dict]] = {name: [] for name, _ in sides}
    wall = dict.fromkeys(recs, 0.0)
    load = os.getloadavg()
    window = [time.monotonic()]       # the trace's clock: which traced requests are this level's
    for k, b in enumerate(range(0, n_requests, level)):
        texts = [ref.TEXTS[i % len(ref.TEXTS)] for i in range(b, min(b + level, n_requests))]
        for name, run in sides[k % len(sides):] + sides[:k % len(sides)]:
            t0 = time.perf_counter()
            recs[name] += await run(texts)
            wall[name] += time.perf_counter() - t0
    window.append(time.monotonic())
    rows, cmps = {}, []
    for v in variants:
        after = scrape_first_output((await client.get(f"{v.url}/metrics")).text)
        srv_n = after[1] - before[v.url][1]
        server_ttfa = round(1000 * (after[0] - before[v.url][0]) / srv_n, 1) if srv_n else None
        o, h, i = v.names()
        rows[i] = speech_row(i, level, recs[i], wall[i], load)
        rows[o] = speech_row(o, level, recs[o], wall[o], load, server_ttfa)
        rows[h] = speech_row(h, level, recs[h], wall[h], load)
        c = compare(level, n_requests, rows[o], rows[i], recs[o], recs[i])
        # In-process: the talker's first sentence, then code2wav's first chunk after it.
        c["in_process_talker_first_ms_p50"] = round(statistics.median(1000 * r["talker_first"] for r in recs[i]), 1)
        c["in_process_code2wav_first_ms_p50"] = round(statistics.median(
            1000 * (r["first"] - r["talker_first"]) for r in recs[i]), 1)
        if level == 1:
            # Judged on the paired differences: TTFA differs by text (its first sentence's length),
            # so a p50 over a mix of texts jumps between texts; a pair's difference does not.
            c["goal"] = "speech first audio at concurrency 1 within +10 ms of in-process (paired p50)"
            c["met"] = c["paired_delta_ms"]["p50"] <= 10.0
        cmps.append(c)
        # The same requests with httpx: its own per-request time is in the difference to `omni`.
        cmps.append(compare(level, n_requests, rows[h], rows[i], recs[h], recs[i]))
        cmps.append(compare(level, n_requests, rows[h], rows[o], recs[h], recs[o]))
    for v in variants[1:]:      # a variant against the deployed chunking, served and in process
        for side in ("omni", "in-process"):
            x, y = f"{side}{v.label}", f"{side}{variants[0].label}"
            cmps.append(compare(level, n_requests, rows[x], rows[y], recs[x], recs[y]))
    for c in cmps:
        c.update(window=window, loadavg_start=[round(x, 2) for x in load],
                 loadavg_end=[round(x, 2) for x in os.getloadavg()])
    return list(rows.values()), cmps


async def chat(client: httpx.AsyncClient, url: str, level: int, n_requests: int, max_tokens: int) -> dict:
    recs, wall = [], 0.0
    load = os.getloadavg()
    for b in range(0, n_requests, level):
        idx = range(b, min(b + level, n_requests))
        t0 = time.perf_counter()
        recs += await asyncio.gather(*[one_chat(client, url, CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_tokens)
                                       for i in idx])
        wall += time.perf_counter() - t0
    return chat_row(level, recs, wall, load)


async def measure(variants: list[Variant], speech_levels, chat_levels, max_tokens: int) -> dict:
    # One client, kept alive: a request's time is the server's, not a TCP handshake's.
    async with httpx.AsyncClient(timeout=600) as client:
        for v in variants:
            await one_speech(client, v.url, "Warm up.")                     # not reported
            await one_speech_raw(v.raw, "Warm up.")
        rows, comparison = [], []
        for c, n in speech_levels:
            r, cmp = await speech_side_by_side(client, variants, c, n)
            rows += r
            comparison += cmp
        for c, n in chat_levels:
            rows.append(await chat(client, variants[0].url, c, n, max_tokens))
        for v in variants:
            await v.raw.close()
    return {"rows": rows, "comparison": comparison}


def start_server(trace: str | None, overrides: dict | None = None):
    """`omni serve` in the background; the caller waits for it with `.http(timeout)`."""
    from tests.e2e.harness import OmniProcess, omni_env

    env = omni_env(OMNI_LATENCY_TRACE=os.path.abspath(trace)) if trace else None
    extra = ("--stage-overrides", json.dumps(overrides)) if overrides else ()
    return OmniProcess("serve", MODEL, "--port", "0", *extra, env=env)


COLS = ["mode", "route", "concurrency", "requests", "ttfa_ms_p50", "ttfa_ms_p10", "ttfa_ms_p90",
        "server_ttfa_ms_mean", "first_sentence_ms_p50", "audio_after_sentence_ms_p50",
        "latency_ms_p50", "request_rtf_mean", "aggregate_rtf", "audio_seconds", "load_1m"]
HEAD = ["mode", "route", "conc", "reqs", "TTFA p50", "p10", "p90", "srv TTFA", "1st sent", "TTFA-sent",
        "lat p50", "req RTF", "agg RTF", "audio s", "load"]


def table(rows: list[dict], cols: list[str] = COLS, head: list[str] = HEAD) -> str:
    cells = [head] + [["-" if r.get(c) is None else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def served_bench_args(doc: str) -> argparse.ArgumentParser:
    """--url, --quick | --full, --json: the options every served speech benchmark takes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="benchmark a running server instead of starting one")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: a short run (< 2 min)")
    mode.add_argument("--full", action="store_true", help="more requests per setting")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    return ap


def main() -> None:
    ap = served_bench_args(__doc__)
    ap.add_argument("--no-chat", action="store_true", help="skip streaming chat with audio")
    ap.add_argument("--max-tokens", type=int, default=32, help="thinker tokens per chat request")
    ap.add_argument("--requests", type=int, help="speech requests per side at concurrency 1 "
                    "(default 32; --full 64)")
    ap.add_argument("--first-chunk-frames", type=int, metavar="N",
                    help="also measure code2wav with an N-frame first chunk, side by side in the same run "
                         "(a second server with that stage override, a second in-process code2wav)")
    ap.add_argument("--trace", metavar="DIR", help="the started server writes per-request timestamps there "
                    "(OMNI_LATENCY_TRACE); the speech hops (benchmarks/latency_trace_report.py) join the output")
    a = ap.parse_args()
    if a.requests is not None and a.requests < 1:
        ap.error("--requests must be >= 1")
    if a.trace and a.url:
        ap.error("--trace needs the server this benchmark starts (not --url)")
    if a.first_chunk_frames is not None and (a.first_chunk_frames < 1 or a.url):
        ap.error("--first-chunk-frames must be >= 1 and needs the servers this benchmark starts (not --url)")
    n1 = a.requests or (64 if a.full else 32)
    speech_levels = [(1, n1), (4, 24)] if a.full else [(1, n1), (4, 8)]
    chat_levels = [(1, 4), (4, 8)] if a.full else [(1, 2), (4, 4)]

    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    args = [code2wav_args()]
    if a.first_chunk_frames:
        args.append(code2wav_args(a.first_chunk_frames))
    procs = []
    try:
        # The servers start while the in-process engines load (start-up is not measured).
        if not a.url:
            procs.append(start_server(a.trace))
        for x in args[1:]:
            procs.append(start_server(None, {str(x.stage_id): {"first_chunk_frames": x.first_chunk_frames}}))
        references = [Reference(x) for x in args]
        urls = [a.url] if a.url else [p.http(600) for p in procs]
        variants = [Variant("" if k == 0 else f" first{x.first_chunk_frames}", x, u, r)
                    for k, (x, u, r) in enumerate(zip(args, urls, references))]
        startup_s = round(time.perf_counter() - t0, 1)
        doc = asyncio.run(measure(variants, speech_levels, chat_levels if not a.no_chat else [], a.max_tokens))
    finally:
        for p in procs:
            p.interrupt(60)
    doc = {"model": MODEL, "sample_rate": RATE, "startup_seconds": startup_s,
           "code2wav": [{"label": v.label.strip() or "deployed", "chunk_frames": v.args.chunk_frames,
                         "first_chunk_frames": v.args.first_chunk_frames, "context_frames": v.args.context_frames}
                        for v in variants],
           "loadavg_start": load_start, **doc}
    if a.trace:
        from benchmarks.latency_trace_report import speech_report

        # Concurrency 1 only: each hop of a lone request.
        doc["speech_hops_ms"] = speech_report(a.trace, *doc["comparison"][0]["window"])
    doc["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    chunking = "; ".join(f"{c['label']}: chunk {c['chunk_frames']}, first {c['first_chunk_frames']}, context "
                         f"{c['context_frames']}" for c in doc["code2wav"])
    print(f"{MODEL}: speech through omni vs the engines in one process, side by side (bursts of <conc> "
          f"requests, every side in turn); code2wav frames ({chunking}); load average "
          f"{doc['loadavg_start']} at the start")
    print(table(doc["rows"]))
    for c in doc["comparison"]:
        d = c["paired_delta_ms"]
        line = (f"speech concurrency {c['concurrency']}: {c['a']} - {c['b']} TTFA p50 {c['ttfa_p50_delta_ms']:+.1f} ms; "
                f"paired (same text, same burst) p50 {d['p50']:+.1f} ms, p10..p90 {d['p10']:+.1f}..{d['p90']:+.1f}")
        if "goal" in c:
            line += f"; goal 4 ({c['goal']}): {'met' if c['met'] else 'NOT met'}"
        print(line + f"; load {c['loadavg_start'][0]}..{c['loadavg_end'][0]}")
    if a.trace:
        c = doc["comparison"][0]
        print(f"speech hops at concurrency 1 (ms, from the trace; in-process p50: talker's first sentence "
              f"{c['in_process_talker_first_ms_p50']}, then code2wav's first chunk "
              f"{c['in_process_code2wav_first_ms_p50']}):")
        for name, s in doc["speech_hops_ms"].items():
            if s["n"]:
                print(f"  {name:<40} n {s['n']:>3}  " + "  ".join(f"{k} {s[k]:>6.1f}" for k in ("p50", "p90", "max")))
    print(f"start-up {doc['startup_seconds']} s; total wall time {doc['seconds']} s; load average "
          f"{doc['loadavg_end']} at the end")


if __name__ == "__main__":
    main()
