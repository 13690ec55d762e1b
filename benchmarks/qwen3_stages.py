"""Qwen3-Omni talker and code2wav engines in one process: step times at concurrency 1 and 4.

Talker: ms per step and per frame (one frame = 80 ms of audio, so real time needs < 80 ms
per frame per request); code2wav: RTF (seconds spent / seconds of audio), streamed in
the talker's chunks (4, then 25 frames). Greedy, float32, one thread. Without a folder it
builds the tiny model (random weights: the numbers measure the machinery, not quality).

    .venv/bin/python benchmarks/qwen3_stages.py [MODEL_DIR] [--frames 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni.engines.base import EngineRequest, SamplingParams  # noqa: E402


def _talker(folder: Path, n: int, frames: int) -> tuple[float, float, torch.Tensor]:
    from transformers import AutoTokenizer

    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    tok = AutoTokenizer.from_pretrained(folder)
    engine = Qwen3TalkerEngine(folder)
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Tell me story number {i}."}],
                                         add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        text = torch.randint(100, 900, (frames // 3,), generator=gen).tolist()
        engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                         sampling=SamplingParams(max_tokens=frames + 1),
                                         voice="ethan", generated_ids=text))
    codes = []
    t0 = time.perf_counter()
    steps = 0
    while engine.has_open_streams():
        steps += 1
        codes += [o.tensors["codes"] for o in engine.step() if o.request_id == "r0" and "codes" in o.tensors]
    spent = time.perf_counter() - t0
    done = engine.stats()["frames"]
    return spent * 1000 / steps, spent * 1000 / done, torch.cat(codes, dim=1)


def _code2wav(folder: Path, n: int, codes: torch.Tensor) -> float:
    from omni.models.qwen3_omni.code2wav import Qwen3Code2WavEngine

    engine = Qwen3Code2WavEngine(folder)
    sizes = [4] + [25] * ((codes.shape[1] - 4) // 25)
    sizes.append(codes.shape[1] - sum(sizes))
    samples = 0
    t0 = time.perf_counter()
    at = 0
    for k, size in enumerate(sizes):
        for i in range(n):
            engine.add_request(EngineRequest(request_id=f"s{i}", tensors={"codes": codes[:, at:at + size]},
                                             final=k == len(sizes) - 1))
        at += size
        while engine.has_unfinished():
            samples += sum(o.tensors["audio"].numel() for o in engine.step())
    return (time.perf_counter() - t0) / (samples / engine.sample_rate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="Qwen3-Omni folder (default: build the tiny one)")
    ap.add_argument("--frames", type=int, default=60, help="talker frames per request")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args()
    if args.frames < 2:
        ap.error("--frames must be >= 2")
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else None
        if folder is None:
            from omni.models import qwen3_omni_tiny

            folder = qwen3_omni_tiny.build(Path(tmp) / "tiny")
        for n in (1, 4):
            step_ms, frame_ms, codes = _talker(folder, n, args.frames)
            rtf = _code2wav(folder, n, codes)
            rows.append({"concurrency": n, "talker_ms_per_step": round(step_ms, 2),
                         "talker_ms_per_frame": round(frame_ms, 2), "code2wav_rtf": round(rtf, 4)})
    doc = {"model": args.model or "tiny (built)", "frames": args.frames, "rows": rows,
           "seconds": round(time.perf_counter() - t0, 1), "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    for r in rows:
        print(f"concurrency {r['concurrency']}: talker {r['talker_ms_per_step']:.1f} ms/step, "
              f"{r['talker_ms_per_frame']:.1f} ms/frame (80 ms of audio per frame); code2wav RTF {r['code2wav_rtf']:.3f}")
    print(f"total wall time {doc['seconds']} s, load average {doc['loadavg_end']} at the end")


if __name__ == "__main__":
    main()
