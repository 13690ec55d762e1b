"""Speech served by omni vs the same engines called in one process.

Time to first audio (TTFA) and real-time factor (RTF = seconds spent / seconds of
audio) at concurrency 1 and 4, for `/v1/audio/speech` and, unless --no-chat,
streaming chat with audio. The in-process rows come from
benchmarks/audio_reference.py (talker + code2wav stepped in one thread, same
texts, same chunking as the deployed code2wav), so the difference is omni's
overhead: processes, channels, shared-memory tensors, HTTP.

Requests arrive in bursts of the concurrency level on both sides. TTFA for
speech is the client's time to the first body byte (`response_format: pcm` streams
as code2wav makes it); `srv TTFA` is the orchestrator's time to the first code2wav
chunk (mean, from /metrics). Chat rows have no in-process twin:
they include the thinker; `1st sent` is when the client's text first held a whole
sentence (what the talker starts from) and `TTFA-sent` the time from there to first
audio: the audio stages' and the pipeline's own share.

    .venv/bin/python benchmarks/audio.py              # --quick, under 2 minutes
    .venv/bin/python benchmarks/audio.py --full       # more requests
    .venv/bin/python benchmarks/audio.py --json       # one JSON document
    .venv/bin/python benchmarks/audio.py --url http://127.0.0.1:8091
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import statistics
import sys
import time
import types
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import audio_reference as ref  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RATE = 22050
CHAT_PROMPTS = [
    "Tell me about cats in two sentences.",
    "Describe the sea in two short sentences.",
    "Say two short sentences about trains.",
    "Tell me about the moon in two sentences.",
]


def code2wav_args() -> types.SimpleNamespace:
    """The deployed code2wav's chunking, so the in-process reference decodes alike."""
    from omni import config

    cfg = config.load(MODEL)
    stage = next(s for s in cfg.stages if s.engine == "piper_code2wav")
    ea = stage.engine_args
    chunk = int(ea.get("chunk_frames", 64))
    return types.SimpleNamespace(chunk_frames=chunk, first_chunk_frames=ea.get("first_chunk_frames") or chunk,
                                 context_frames=int(ea.get("context_frames", 16)), threads=int(ea.get("threads", 1)))


def reference_rows(levels: list[tuple[int, int]]) -> list[dict]:
    import torch

    from omni.engines.onnx_audio import Code2WavEngine, TalkerEngine
    from omni.models.piper_voice import prepare_voice

    torch.set_num_threads(1)
    args = code2wav_args()
    voice = prepare_voice("joe")
    talker = TalkerEngine(voice, threads=args.threads)
    ref.run_burst(talker, Code2WavEngine(voice, threads=args.threads), ["Warm up."], "warm")
    return [{"mode": "in-process", "route": "speech", **ref.concurrency(talker, voice, args, c, n)}
            for c, n in levels]


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


async def one_chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    from omni.processors import _SENTENCE_END

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
                # The talker starts on a sentence once its end is seen (omni.processors.thinker_to_talker).
                if sentence is None and _SENTENCE_END.search(text):
                    sentence = time.perf_counter() - t0
                data = (c["delta"].get("audio") or {}).get("data")
                if data:
                    if first is None:
                        first = time.perf_counter() - t0
                    n += len(base64.b64decode(data)) // 2
    done = time.perf_counter() - t0
    # No sentence end in the text: the talker got it all when the thinker finished.
    return {"first": first, "done": done, "samples": n, "sentence": sentence}


async def served(url: str, route: str, level: int, n_requests: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        before = scrape_first_output((await client.get(f"{url}/metrics")).text)
        recs, wall = [], 0.0
        for b in range(0, n_requests, level):
            idx = range(b, min(b + level, n_requests))
            t0 = time.perf_counter()
            if route == "speech":
                burst = [one_speech(client, url, ref.TEXTS[i % len(ref.TEXTS)]) for i in idx]
            else:
                burst = [one_chat(client, url, CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_tokens) for i in idx]
            recs += await asyncio.gather(*burst)
            wall += time.perf_counter() - t0
        after = scrape_first_output((await client.get(f"{url}/metrics")).text)
    audio_s = sum(r["samples"] for r in recs) / RATE
    ttfa = [1000 * r["first"] for r in recs if r["first"] is not None]
    srv_n = after[1] - before[1]
    sentence = [1000 * r["sentence"] for r in recs if r.get("sentence") is not None]
    share = [1000 * (r["first"] - r["sentence"]) for r in recs
             if r.get("sentence") is not None and r["first"] is not None]
    return {
        "mode": "omni", "route": route, "concurrency": level, "requests": n_requests,
        "ttfa_ms_p50": round(statistics.median(ttfa), 1) if ttfa else None,
        "ttfa_ms_p90": round(ref._pct(ttfa, 0.9), 1) if ttfa else None,
        # The orchestrator's first final output: audio for speech, the first text token for chat.
        "server_ttfa_ms_mean": round(1000 * (after[0] - before[0]) / srv_n, 1)
        if srv_n and route == "speech" else None,
        # Chat: when the thinker's text held its first sentence (the talker's first input), and
        # first audio minus that: the audio stages' and the pipeline's own share of TTFA.
        "first_sentence_ms_p50": round(statistics.median(sentence), 1) if sentence else None,
        "audio_after_sentence_ms_p50": round(statistics.median(share), 1) if share else None,
        "latency_ms_p50": round(1000 * statistics.median(r["done"] for r in recs), 1),
        "request_rtf_mean": round(statistics.mean(r["done"] / (r["samples"] / RATE) for r in recs
                                                  if r["samples"]), 4),
        "aggregate_rtf": round(wall / audio_s, 4) if audio_s else None,
        "audio_seconds": round(audio_s, 2),
    }


def start_server():
    from tests.e2e.harness import OmniProcess

    p = OmniProcess("serve", MODEL, "--port", "0")
    try:
        return p, p.http(600)
    except BaseException:
        p.kill()
        raise


COLS = ["mode", "route", "concurrency", "requests", "ttfa_ms_p50", "ttfa_ms_p90", "server_ttfa_ms_mean",
        "first_sentence_ms_p50", "audio_after_sentence_ms_p50",
        "latency_ms_p50", "request_rtf_mean", "aggregate_rtf", "audio_seconds"]
HEAD = ["mode", "route", "conc", "reqs", "TTFA p50", "TTFA p90", "srv TTFA", "1st sent", "TTFA-sent",
        "lat p50", "req RTF", "agg RTF", "audio s"]


def table(rows: list[dict]) -> str:
    cells = [HEAD] + [["-" if r.get(c) is None else str(r[c]) for c in COLS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLS))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="benchmark a running server instead of starting one")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: a short run (< 2 min)")
    mode.add_argument("--full", action="store_true", help="more requests per setting")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--no-chat", action="store_true", help="skip streaming chat with audio")
    ap.add_argument("--max-tokens", type=int, default=32, help="thinker tokens per chat request")
    a = ap.parse_args()
    speech_levels = [(1, 12), (4, 24)] if a.full else [(1, 4), (4, 4)]
    chat_levels = [(1, 4), (4, 8)] if a.full else [(1, 1), (4, 4)]

    t0 = time.perf_counter()
    rows = reference_rows(speech_levels)      # first, so the server does not share the cores with it
    proc, url = (None, a.url) if a.url else start_server()
    try:
        asyncio.run(served(url, "speech", 1, 1, a.max_tokens))     # warm-up, not reported
        for c, n in speech_levels:
            rows.append(asyncio.run(served(url, "speech", c, n, a.max_tokens)))
        if not a.no_chat:
            for c, n in chat_levels:
                rows.append(asyncio.run(served(url, "chat", c, n, a.max_tokens)))
    finally:
        if proc is not None:
            proc.interrupt(60)
    args = code2wav_args()
    doc = {"model": MODEL, "sample_rate": RATE, "seconds": round(time.perf_counter() - t0, 1),
           "code2wav": {"chunk_frames": args.chunk_frames, "first_chunk_frames": args.first_chunk_frames,
                        "context_frames": args.context_frames},
           "rows": rows}
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{MODEL}: speech through omni vs the engines in one process (bursts of <conc> requests); "
          f"code2wav chunk {args.chunk_frames}, first {args.first_chunk_frames}, context {args.context_frames} "
          f"frames; {doc['seconds']} s")
    print(table(rows))


if __name__ == "__main__":
    main()
