"""One-process reference for the audio stages: talker + code2wav engines called
directly (no omni runtime, no transport), to compare with the served pipeline.

Figures:
  components   talker / code2wav cost in ms per second of audio produced, the
               streaming decode's cost, and its max abs difference to one-shot;
  concurrency  time to first audio chunk (TTFA) and real-time factor for 1 and
               4 requests in flight. Requests arrive together in bursts of the
               concurrency level; one thread steps the talker and the code2wav
               engine alternately (like two stage processes sharing one core),
               each engine serving its requests round-robin.

    python benchmarks/audio_reference.py            # table, about 30 s
    python benchmarks/audio_reference.py --json     # the same figures as JSON
    python benchmarks/audio_reference.py --full     # more requests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni.engines.base import EngineRequest, SamplingOverrides  # noqa: E402
from omni.models.piper.engines import Code2WavEngine, TalkerEngine, code2wav_request  # noqa: E402
from omni.models.piper.voice import prepare_voice  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was not amused.",
    "Streaming speech should start early. Nobody likes to wait for the first word.",
    "A stage runtime moves tensors between processes, and keeps each stage busy.",
    "How much wood would a woodchuck chuck? Quite a lot, it turns out.",
    "Please read the numbers back to me: four, eight, fifteen, sixteen, twenty three.",
    "Tomorrow will be sunny in the morning, with clouds rolling in after lunch.",
]
DETERMINISTIC = SamplingOverrides(noise_scale=0.0, noise_w_scale=0.0)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def components(talker: TalkerEngine, voice, args) -> dict:
    """Per-stage cost on every text, one request at a time."""
    one_shot = Code2WavEngine(voice, chunk_frames=1_000_000, threads=args.threads)
    stream = Code2WavEngine(voice, chunk_frames=args.chunk_frames, context_frames=args.context_frames,
                            first_chunk_frames=args.first_chunk_frames, threads=args.threads)
    t_talk = t_one = t_stream = audio_s = 0.0
    max_diff = 0.0
    for i, text in enumerate(TEXTS * args.repeat):
        rid = f"c{i}"
        t0 = time.perf_counter()
        talker.add_request(EngineRequest(request_id=rid, text=text, overrides=DETERMINISTIC))
        pieces = []
        while talker.has_unfinished():
            pieces += talker.step()
        t_talk += time.perf_counter() - t0
        lat = torch.cat([p.tensors["latents"] for p in pieces], dim=2)
        t0 = time.perf_counter()
        one_shot.add_request(EngineRequest(request_id=rid, tensors={"latents": lat}))
        ref = np.concatenate([o.tensors["audio"].numpy() for o in one_shot.step()])
        t_one += time.perf_counter() - t0
        t0 = time.perf_counter()
        chunks = []
        for p in pieces:
            stream.add_request(code2wav_request(p))
            while stream.has_ready_work():
                chunks += stream.step()
        t_stream += time.perf_counter() - t0
        joined = np.concatenate([c.tensors["audio"].numpy() for c in chunks])
        max_diff = max(max_diff, float(np.abs(joined - ref).max()))
        audio_s += len(ref) / voice.sample_rate
    return {
        "audio_seconds": round(audio_s, 3),
        "talker_ms_per_audio_s": round(1000 * t_talk / audio_s, 1),
        "code2wav_one_shot_ms_per_audio_s": round(1000 * t_one / audio_s, 1),
        "code2wav_streaming_ms_per_audio_s": round(1000 * t_stream / audio_s, 1),
        "rtf_one_shot": round((t_talk + t_one) / audio_s, 4),
        "streaming_max_abs_diff": max_diff,
    }


def run_burst(talker: TalkerEngine, c2w: Code2WavEngine, texts: list[str], tag: str) -> list[dict]:
    """All texts submitted at once; step both engines until every stream ends."""
    start = time.perf_counter()
    recs = {}
    for i, text in enumerate(texts):
        rid = f"{tag}-{i}"
        talker.add_request(EngineRequest(request_id=rid, text=text, overrides=DETERMINISTIC))
        recs[rid] = {"first": None, "done": None, "samples": 0, "talker_first": None}
    while talker.has_unfinished() or c2w.has_unfinished():
        for out in talker.step():
            r = recs[out.request_id]
            if r["talker_first"] is None:
                r["talker_first"] = time.perf_counter() - start
            c2w.add_request(code2wav_request(out))
        for out in c2w.step():
            now = time.perf_counter()
            r = recs[out.request_id]
            if out.error:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            n = out.tensors["audio"].numel()
            if n and r["first"] is None:
                r["first"] = now - start
            r["samples"] += n
            if out.finished:
                r["done"] = now - start
    return list(recs.values())


def concurrency(talker, voice, args, level: int, n_requests: int) -> dict:
    c2w = Code2WavEngine(voice, chunk_frames=args.chunk_frames, context_frames=args.context_frames,
                         first_chunk_frames=args.first_chunk_frames, threads=args.threads)
    texts = [TEXTS[i % len(TEXTS)] for i in range(n_requests)]
    recs, wall = [], 0.0
    for b in range(0, n_requests, level):
        t0 = time.perf_counter()
        recs += run_burst(talker, c2w, texts[b:b + level], f"l{level}b{b}")
        wall += time.perf_counter() - t0
    sr = voice.sample_rate
    audio_s = sum(r["samples"] for r in recs) / sr
    ttfa = [1000 * r["first"] for r in recs]
    return {
        "concurrency": level,
        "requests": n_requests,
        "ttfa_ms_p50": round(statistics.median(ttfa), 1),
        "ttfa_ms_p90": round(_pct(ttfa, 0.9), 1),
        "latency_ms_p50": round(1000 * statistics.median(r["done"] for r in recs), 1),
        "request_rtf_mean": round(statistics.mean(r["done"] / (r["samples"] / sr) for r in recs), 4),
        "aggregate_rtf": round(wall / audio_s, 4),
        "audio_seconds": round(audio_s, 2),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the chunking and threads left out are the deployed code2wav's (benchmarks/audio.py
    code2wav_args), so the reference decodes as the served pipeline does."""
    from benchmarks.audio import code2wav_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: a short run (< 2 min)")
    mode.add_argument("--full", action="store_true", help="more requests per setting")
    ap.add_argument("--voice", default="joe")
    deployed = "default: the deployed code2wav's"
    ap.add_argument("--chunk-frames", type=int, help=deployed)
    ap.add_argument("--first-chunk-frames", type=int, help=deployed)
    ap.add_argument("--context-frames", type=int, help=deployed)
    ap.add_argument("--threads", type=int, help=f"onnxruntime intra-op threads ({deployed})")
    args = ap.parse_args(argv)
    for flag, least in (("chunk_frames", 1), ("first_chunk_frames", 1), ("context_frames", 0), ("threads", 1)):
        if getattr(args, flag) is not None and getattr(args, flag) < least:
            ap.error(f"--{flag.replace('_', '-')} must be at least {least}, got {getattr(args, flag)}")
    d = code2wav_args()
    for flag in ("chunk_frames", "first_chunk_frames", "context_frames", "threads"):
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(d, flag))
    args.repeat = 3 if args.full else 1
    return args


def main() -> None:
    args = parse()
    torch.set_num_threads(1)

    t_start = t0 = time.perf_counter()
    voice = prepare_voice(args.voice)
    prepare_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    talker = TalkerEngine(voice, threads=args.threads)
    load_s = time.perf_counter() - t0
    # Warm up both graphs so the first measured request is not a cold start.
    warm = Code2WavEngine(voice, threads=args.threads)
    run_burst(talker, warm, ["Warm up."], "warm")

    comp = components(talker, voice, args)
    n = 24 if args.full else 8
    conc = [concurrency(talker, voice, args, 1, n // 2), concurrency(talker, voice, args, 4, n)]
    doc = {
        "voice": voice.name, "sample_rate": voice.sample_rate,
        "split_seconds": json.loads((voice.dir / "meta.json").read_text()).get("split_seconds"),
        "prepare_seconds_this_run": round(prepare_s, 3),
        "talker_load_seconds": round(load_s, 3),
        "streaming": {"chunk_frames": args.chunk_frames, "first_chunk_frames": args.first_chunk_frames,
                      "context_frames": args.context_frames},
        "threads": args.threads,
        "scheduling": "one thread; bursts of <concurrency> requests; talker and code2wav stepped alternately",
        "components": comp,
        "concurrency": conc,
        "seconds": round(time.perf_counter() - t_start, 1),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
        return
    print(f"voice {voice.name} ({voice.sample_rate} Hz), split {doc['split_seconds']} s when prepared, "
          f"talker load {doc['talker_load_seconds']} s, threads {args.threads}")
    print(f"streaming: chunk {args.chunk_frames} frames, first chunk {args.first_chunk_frames}, "
          f"context {args.context_frames}")
    print()
    for k, v in comp.items():
        print(f"  {k:36s} {v}")
    print()
    cols = ["concurrency", "requests", "ttfa_ms_p50", "ttfa_ms_p90", "latency_ms_p50",
            "request_rtf_mean", "aggregate_rtf", "audio_seconds"]
    print("  ".join(f"{c:>16s}" for c in cols))
    for row in conc:
        print("  ".join(f"{row[c]:>16}" for c in cols))
    print(f"\ntotal wall time {doc['seconds']} s, load average {doc['loadavg_end']} at the end")


if __name__ == "__main__":
    main()
