"""Qwen2.5-Omni token2wav streamed in blocks against a whole decode: first audio, total time,
real-time factor and the streamed audio's difference from the whole decode's (same codes, seed).

Each request's codes are all there at once (a final piece), so `first audio` is the engine's own
part: the whole decode's first audio is its whole decode, the streamed one's its first block's
decode (in the pipeline the first block also waits for first_block_codes + right_context codes
from the talker). Runs interleave whole and streamed; medians. `--sweep` adds the error for other
block sizes and contexts. Without `--real-size` it builds the tiny model (random weights: the
errors measure the method on those weights, not on trained ones); `--real-size` builds
transformers' default token2wav config (Qwen2.5-Omni-7B's sizes: DiT 1024 x 22 layers, BigVGAN 1536
channels) in memory with random weights, nothing on disk.

    .venv/bin/python benchmarks/token2wav_stream.py [--quick | --full] [--codes 125] [--runs 3] [--sweep] [--json]
    python benchmarks/token2wav_stream.py --real-size --device cuda --codes 250
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni.engines.base import EngineRequest, SamplingParams  # noqa: E402

DEFAULTS = dict(first_block_codes=12, block_codes=36, left_context=24, right_context=12, vocoder_context=32)
SWEEP = [dict(DEFAULTS, **kw) for kw in (
    {"left_context": 0}, {"left_context": 12}, {"right_context": 0}, {"right_context": 4},
    {"right_context": 6}, {"right_context": 24}, {"vocoder_context": 0}, {"vocoder_context": 16},
    {"first_block_codes": 6, "block_codes": 24}, {"first_block_codes": 24, "block_codes": 48})]


def real_size_parts(device: str):
    """transformers' default token2wav config with random weights, built on `device`."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniToken2WavModel

    from omni.models.qwen25_omni.token2wav import Token2WavParts

    config = Qwen2_5OmniConfig()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config, dtype=torch.float32).eval()
    with torch.no_grad():
        # std-0.02 convolutions leave BigVGAN's output ~0 (as in the tiny builder): torch's own init.
        for m in model.code2wav_bigvgan_model.modules():
            if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                m.reset_parameters()
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"non-finite parameters after init: {bad[:5]}")
    dit = config.token2wav_config.dit_config
    gen = torch.Generator().manual_seed(1)
    speakers = {"chelsie": {"cond": torch.randn(dit.enc_emb_dim, generator=gen),
                            "ref_mel": torch.randn(1, 300, dit.mel_dim, generator=gen) * 2 - 6}}
    return Token2WavParts(config, model, speakers)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_once(engine, codes: torch.Tensor, device: str, streams: int = 1) -> dict:
    """All of each request's codes in one final piece; times to the first and the last output."""
    for i in range(streams):
        engine.add_request(EngineRequest(request_id=f"r{i}", tensors={"codes": codes[None]},
                                         sampling=SamplingParams(seed=3), voice="chelsie"))
    _sync(device)
    t0 = time.perf_counter()
    first, chunks = None, []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "r0":
                chunks.append(o.tensors["audio"])
            if first is None and o.tensors["audio"].numel():
                first = time.perf_counter() - t0
    _sync(device)
    total = time.perf_counter() - t0
    audio = torch.cat(chunks)
    return {"first_audio_ms": 1000 * first, "total_ms": 1000 * total,
            "rtf": total / (streams * audio.numel() / engine.sample_rate), "audio": audio}


def progress(text: str) -> None:
    """A line on stderr as each part finishes: a run cut off by a time limit still leaves its figures."""
    print(f"token2wav: {text}", file=sys.stderr, flush=True)


def timing(r: dict) -> str:
    return f"first audio {r['first_audio_ms']:.1f} ms, total {r['total_ms']:.1f} ms, RTF {r['rtf']:.3f}"


def errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = got - want
    return {"max_abs_err": d.abs().max().item(),
            "rms_rel_err": (d.pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codes", type=int, default=125, help="codes per request (50 per second of audio)")
    ap.add_argument("--runs", type=int, help="interleaved runs of each mode, medians (--quick 3, --full 7)")
    ap.add_argument("--streams", type=int, default=1, help="concurrent requests")
    ap.add_argument("--sweep", action="store_true", help="also the error of other block sizes and contexts")
    ap.add_argument("--real-size", action="store_true", help="Qwen2.5-Omni-7B's token2wav, random weights")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="the default: a short run (< 2 min)")
    length.add_argument("--full", action="store_true", help="more runs, and the --sweep")
    args = ap.parse_args()
    args.runs = (7 if args.full else 3) if args.runs is None else args.runs
    args.sweep = args.sweep or args.full
    if args.codes < 1 or args.runs < 1 or args.streams < 1:
        ap.error("--codes, --runs and --streams must be >= 1")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    wall0, load0 = time.perf_counter(), os.getloadavg()[0]
    from omni.models.qwen25_omni.token2wav import Qwen25Token2WavEngine

    tmp = None
    if args.real_size:
        source = real_size_parts(args.device)
    else:
        from omni.models.qwen25_omni import tiny as qwen25_omni_tiny

        tmp = tempfile.TemporaryDirectory()
        source = qwen25_omni_tiny.build(Path(tmp.name) / "tiny")
    engines = {"whole": Qwen25Token2WavEngine(source, device=args.device, stream=False),
               "streamed": Qwen25Token2WavEngine(source, device=args.device, **DEFAULTS)}
    progress(f"engines built in {time.perf_counter() - wall0:.1f} s")
    codes = torch.randint(0, 8193, (args.codes,), generator=torch.Generator().manual_seed(0))
    runs: dict[str, list[dict]] = {k: [] for k in engines}
    for engine in engines.values():
        run_once(engine, codes[:min(24, args.codes)], args.device)          # warm-up
    for i in range(args.runs):
        for mode, engine in engines.items():
            runs[mode].append(run_once(engine, codes, args.device, args.streams))
            progress(f"{mode} run {i + 1}/{args.runs}: {timing(runs[mode][-1])}")
    whole = runs["whole"][0]["audio"]
    rows = []
    for mode, rs in runs.items():
        row = {"mode": mode, **{k: statistics.median(r[k] for r in rs) for k in ("first_audio_ms", "total_ms", "rtf")}}
        row.update(errors(rs[0]["audio"], whole))
        rows.append(row)
        progress(f"{mode} medians: {timing(row)}, max|err| {row['max_abs_err']:.2e}, rms rel {row['rms_rel_err']:.2e}")
    sweep = []
    if args.sweep:
        for cfg in SWEEP:
            got = run_once(Qwen25Token2WavEngine(source, device=args.device, **cfg), codes, args.device)
            sweep.append({**cfg, **errors(got["audio"], whole)})
            progress(f"sweep {cfg}: max|err| {sweep[-1]['max_abs_err']:.2e}, rms rel {sweep[-1]['rms_rel_err']:.2e}")
    doc = {"model": "real-size (7B config, random weights)" if args.real_size else "tiny (random weights)",
           "device": args.device, "codes": args.codes, "streams": args.streams, "runs": args.runs,
           "stream_args": DEFAULTS, "rows": rows, "sweep": sweep,
           "wall_s": time.perf_counter() - wall0, "load": [load0, os.getloadavg()[0]]}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"token2wav, {doc['model']}, {args.device}, {args.codes} codes ({args.codes / 50:.2f} s of audio), "
              f"{args.streams} stream(s), medians of {args.runs}; streamed: {DEFAULTS}; "
              f"{doc['wall_s']:.0f} s at load {doc['load'][0]:.1f} .. {doc['load'][1]:.1f}")
        print(f"{'mode':10} {'first audio ms':>15} {'total ms':>10} {'RTF':>7} {'max|err|':>10} {'rms rel':>9}")
        for r in rows:
            print(f"{r['mode']:10} {r['first_audio_ms']:15.1f} {r['total_ms']:10.1f} {r['rtf']:7.3f} "
                  f"{r['max_abs_err']:10.2e} {r['rms_rel_err']:9.2e}")
        if sweep:
            print("\nstreamed error against the whole decode (first, block, left, right, vocoder context):")
            for s in sweep:
                print(f"  {s['first_block_codes']:3} {s['block_codes']:3} {s['left_context']:3} {s['right_context']:3} "
                      f"{s['vocoder_context']:3}: max|err| {s['max_abs_err']:.2e}  rms rel {s['rms_rel_err']:.2e}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
