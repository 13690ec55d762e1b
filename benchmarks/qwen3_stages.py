"""Qwen3-Omni (or Qwen2.5-Omni) talker and code2wav engines in one process, driven as the stage worker
drives them (add the requests, step while there is work), each decode path side by side.

Talker rows, per decode path and number of streams: ms per step (each stream gets one frame a step:
80 ms of audio for Qwen3, 20 ms for Qwen2.5, so real time needs less than that), ms per frame
(the step shared by its streams), frames/s per stream, first audio (from adding a request's
first piece to its first codes chunk: the prefill plus 3 frames), GPU memory. Paths: `eager`
(transformers' modules, DynamicCache: static_decode false), `static` (the static step without
CUDA graphs: enforce_eager) and, on CUDA, `graphed`. Rounds alternate the paths (paired);
figures are medians over rounds. code2wav: RTF streamed in the talker's chunks (4, then 25).

Without a folder it builds the tiny model (random weights: the figures measure the machinery, not
quality); `--real-size` builds the released sizes with random weights in memory (benchmarks/
real_size.py), `--device cuda` for a GPU. Greedy, one thread on CPU.

    .venv/bin/python benchmarks/qwen3_stages.py [MODEL_DIR] [--model qwen3|qwen25] [--streams 1,4,16,64]
        [--quick | --full] [--frames 40] [--rounds 3] [--modes eager,static,graphed] [--real-size] [--device cpu|cuda] [--json]

Each stream count's rows also go to stderr as they finish.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import real_size  # noqa: E402
from omni.engines.base import EngineRequest, SamplingParams  # noqa: E402

FRAME_AUDIO_MS = {"qwen3": 80.0, "qwen25": 20.0}


class Source:
    """Where the engines' weights come from: a folder (tiny or given) or real-size parts in memory."""

    def __init__(self, model: str, folder: Path | None, device: str, real: bool):
        self.model, self.folder, self.device, self.real = model, folder, device, real
        self.dtype = torch.bfloat16 if real else torch.float32
        self._talker = self._code2wav = None
        if real:
            self.config = real_size.qwen3_config() if model == "qwen3" else real_size.qwen25_config()
        else:
            from transformers import AutoConfig, AutoTokenizer

            self.config = AutoConfig.from_pretrained(folder)
            self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def talker(self, mode: str, slots: int):
        kw = dict(device=self.device, dtype=str(self.dtype).removeprefix("torch."))
        if self.model == "qwen3":
            from omni.models.qwen3_omni.talker import Qwen3TalkerEngine as cls
        else:
            from omni.models.qwen25_omni.talker import Qwen25TalkerEngine as cls
        kw.update(static_decode=mode != "eager", enforce_eager=mode != "graphed", max_num_seqs=slots)
        if self.real and self._talker is None:
            parts = real_size.qwen3_talker_parts if self.model == "qwen3" else real_size.qwen25_talker_parts
            self._talker = parts(self.device, self.dtype)
        return cls(self.folder, parts=self._talker, **kw) if self.real else cls(self.folder, **kw)

    def code2wav(self):
        from omni.models.qwen3_omni.code2wav import Qwen3Code2WavEngine

        if self.real and self._code2wav is None:
            self._code2wav = real_size.qwen3_code2wav_parts(self.device, self.dtype)
        kw = dict(device=self.device, dtype=str(self.dtype).removeprefix("torch."))
        return Qwen3Code2WavEngine(self.folder, parts=self._code2wav, **kw)

    def prompt(self, i: int) -> list[int]:
        if self.real:
            return real_size.prompt_ids(self.config, 24, i)
        return self.tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me story number {i}."}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]

    def request(self, i: int, frames: int) -> EngineRequest:
        g = torch.Generator().manual_seed(i)
        prompt = self.prompt(i)
        text = torch.randint(100, 900, (max(2, frames // 3),), generator=g).tolist()
        tensors = {}
        if self.model == "qwen25":      # the thinker's rows: one per prompt position and generated id
            h = self.config.thinker_config.text_config.hidden_size
            tensors["thinker_hidden"] = torch.randn(len(prompt) + len(text), h, generator=g)
        return EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, tensors=tensors,
                             sampling=SamplingParams(max_tokens=frames + 1),
                             voice="chelsie" if self.model == "qwen25" else "ethan", generated_ids=text)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_talker(engine, source: Source, n: int, frames: int) -> dict:
    """n streams through the engine; per-step wall times of decode steps and each stream's first audio."""
    before = engine.stats().get("prefill_tokens", 0)
    t0 = time.perf_counter()
    for i in range(n):
        engine.add_request(source.request(i, frames))
    first: dict[str, float] = {}
    steps, codes = [], []
    while engine.has_open_streams():
        s = time.perf_counter()
        outs = engine.step()
        _sync(source.device)
        now = time.perf_counter()
        if engine.stats().get("prefill_tokens", 0) == before or len(first) == n:
            steps.append(now - s)         # decode steps only: no prefill in them
        before = engine.stats().get("prefill_tokens", 0)
        for o in outs:
            if o.tensors.get("codes") is not None and o.tensors["codes"].shape[1]:
                first.setdefault(o.request_id, now - t0)
                if o.request_id == "r0":
                    codes.append(o.tensors["codes"])
    return {"steps": steps, "first": list(first.values()), "codes": torch.cat(codes, dim=1)}


def talker_row(model: str, mode: str, n: int, runs: list[dict], mem_gib: float | None) -> dict:
    step = statistics.median(statistics.median(r["steps"]) for r in runs) * 1000
    first = statistics.median(statistics.median(r["first"]) for r in runs) * 1000
    return {"model": model, "mode": mode, "streams": n, "talker_ms_per_step": round(step, 2),
            "talker_ms_per_frame": round(step / n, 3), "frames_per_s_per_stream": round(1000 / step, 1),
            "x_real_time_per_stream": round(FRAME_AUDIO_MS[model] / step, 2), "first_audio_ms": round(first, 1),
            "gpu_mem_gib": mem_gib, "rounds": len(runs)}


def run_code2wav(engine, n: int, codes: torch.Tensor) -> float:
    sizes = [4] + [25] * ((codes.shape[1] - 4) // 25)
    sizes.append(codes.shape[1] - sum(sizes))
    samples, at = 0, 0
    t0 = time.perf_counter()
    for k, size in enumerate(sizes):
        for i in range(n):
            engine.add_request(EngineRequest(request_id=f"s{i}", tensors={"codes": codes[:, at:at + size]},
                                             final=k == len(sizes) - 1))
        at += size
        while engine.has_unfinished():
            samples += sum(o.tensors["audio"].numel() for o in engine.step())
    return (time.perf_counter() - t0) / (samples / engine.sample_rate)


def modes_for(model: str, device: str) -> list[str]:
    modes = ["eager", "static"]
    if device.startswith("cuda"):
        modes.append("graphed")
    return modes


def progress(text: str, name: str = "qwen3_stages") -> None:
    """A line on stderr as each part finishes: a run cut off by a time limit still leaves its figures."""
    print(f"{name}: {text}", file=sys.stderr, flush=True)


def attempt(errors: dict, mode: str, what: str, fn, *args):
    """fn(*args)'s result, or None with the path's failure recorded: on a GPU, one path that breaks (a graph
    that will not capture, say) must not cost the figures of the others. Reported, not hidden: the
    JSON's "errors", stderr and the table."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        errors[mode] = f"{what}: {type(e).__name__}: {e}"[:2000]
        progress(f"{mode} failed {errors[mode]}")
        traceback.print_exc()
        return None


def bench(source: Source, streams: list[int], frames: int, rounds: int, modes: list[str] | None = None) -> dict:
    engines, capture, errors = {}, {}, {}
    for mode in modes or modes_for(source.model, source.device):
        engine = attempt(errors, mode, "building", source.talker, mode, max(streams))
        if engine is None:
            continue
        engines[mode] = engine
        graphs = getattr(getattr(engine, "_static", None), "graphs", None)
        if graphs is not None:
            capture[mode] = round(graphs.seconds, 2)
    progress(f"engines built ({', '.join(engines)}); CUDA graph capture {capture or '-'} s")
    for mode in list(engines):                  # warm-up: first calls allocate
        if attempt(errors, mode, "warm-up", run_talker, engines[mode], source, 1, 6) is None:
            del engines[mode]
    rows, codes = [], {}
    for n in streams:
        runs: dict[str, list] = {m: [] for m in engines}
        peak: dict[str, float] = {}
        for _ in range(rounds):
            for mode in list(engines):
                if source.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                r = attempt(errors, mode, f"{n} streams", run_talker, engines[mode], source, n, frames)
                if r is None:
                    del engines[mode], runs[mode]
                    continue
                runs[mode].append(r)
                codes[mode] = r["codes"]
                if source.device.startswith("cuda"):
                    peak[mode] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        done = [talker_row(source.model, m, n, runs[m], peak.get(m)) for m in runs]
        for r in done:
            progress(f"{r['mode']} {n} streams: {r['talker_ms_per_step']} ms/step, first audio {r['first_audio_ms']} ms")
        rows += done
    if not engines:
        raise SystemExit(f"qwen3_stages: every path failed: {errors}")
    modes = list(engines)
    same = all(torch.equal(codes[m], codes[modes[0]]) for m in modes) if not source.real and len(modes) > 1 else None
    doc = {"rows": rows, "capture_seconds": capture, "codes_equal_across_paths": same, "errors": errors,
           "talker_ms_per_frame": {r["mode"]: r["talker_ms_per_frame"] for r in rows if r["streams"] == 1}}
    if source.model == "qwen3":     # a code2wav failure is reported like a talker path's, the rest kept
        doc["code2wav"] = []
        c2w = attempt(errors, "code2wav", "building", source.code2wav)
        for n in streams if c2w is not None else []:
            rtf = attempt(errors, "code2wav", f"{n} streams", run_code2wav, c2w, n, codes[modes[-1]])
            if rtf is None:
                break
            doc["code2wav"].append({"streams": n, "rtf": round(rtf, 4)})
            progress(f"code2wav {n} streams: RTF {rtf:.3f}")
    return doc


def source_args(ap: argparse.ArgumentParser) -> None:
    """The arguments saying which talker and where (shared with benchmarks/talker_frame.py)."""
    ap.add_argument("folder", nargs="?", help="model folder (default: build the tiny one)")
    ap.add_argument("--model", choices=["qwen3", "qwen25"], default="qwen3")
    ap.add_argument("--real-size", action="store_true", help="the released sizes, random weights, in memory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="the default: a short run (< 2 min on the tiny model)")
    length.add_argument("--full", action="store_true", help="longer runs (more frames and rounds)")


def check_source_args(ap: argparse.ArgumentParser, args) -> None:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.real_size and args.folder:
        ap.error("--real-size builds the model: give no folder")
    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)


def open_source(args, tmp: str) -> Source:
    """The weights `args` name: a folder, the released sizes in memory, or the tiny model built in tmp."""
    folder = Path(args.folder) if args.folder else None
    if folder is None and not args.real_size:
        if args.model == "qwen3":
            from omni.models.qwen3_omni import tiny
        else:
            from omni.models.qwen25_omni import tiny
        folder = tiny.build(Path(tmp) / "tiny")
    return Source(args.model, folder, args.device, args.real_size)


def weights(args) -> str:
    return "real size, random" if args.real_size else (args.folder or "tiny")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source_args(ap)
    ap.add_argument("--streams", default="1,4,16,64", help="comma-separated stream counts")
    ap.add_argument("--frames", type=int, help="talker frames per request (--quick 40, --full 120)")
    ap.add_argument("--rounds", type=int, help="paired rounds per stream count (--quick 3, --full 5)")
    ap.add_argument("--modes", help="comma-separated decode paths (default: eager,static, and graphed on CUDA)")
    args = ap.parse_args()
    args.frames = (120 if args.full else 40) if args.frames is None else args.frames
    args.rounds = (5 if args.full else 3) if args.rounds is None else args.rounds
    try:
        streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        ap.error(f"--streams must be comma-separated integers, got {args.streams!r}")
    if args.frames < 6 or args.rounds < 1 or min(streams) < 1:
        ap.error("--frames must be >= 6, --rounds >= 1 and every --streams entry >= 1")
    check_source_args(ap, args)
    modes = modes_for(args.model, args.device)
    if args.modes:
        wanted = args.modes.split(",")
        if set(wanted) - set(modes):
            ap.error(f"--modes: the paths on {args.device} are {','.join(modes)}; got {args.modes!r}")
        modes = [m for m in modes if m in wanted]
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        doc = bench(open_source(args, tmp), streams, args.frames, args.rounds, modes)
    doc.update({"model": args.model, "weights": weights(args), "device": args.device, "frames": args.frames,
                "seconds": round(time.perf_counter() - t0, 1),
                "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()]})
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{'path':8} {'streams':>7} {'ms/step':>9} {'ms/frame':>9} {'frames/s/stream':>15} {'x real time':>11} "
          f"{'first audio ms':>14} {'GPU GiB':>8}")
    for r in doc["rows"]:
        print(f"{r['mode']:8} {r['streams']:>7} {r['talker_ms_per_step']:>9.2f} {r['talker_ms_per_frame']:>9.3f} "
              f"{r['frames_per_s_per_stream']:>15.1f} {r['x_real_time_per_stream']:>11.2f} {r['first_audio_ms']:>14.1f} "
              f"{r['gpu_mem_gib'] if r['gpu_mem_gib'] is not None else '-':>8}")
    for c in doc.get("code2wav", []):
        print(f"code2wav {c['streams']} streams: RTF {c['rtf']:.3f}")
    for mode, error in doc["errors"].items():
        print(f"{mode} FAILED, {error}")
    if doc["capture_seconds"]:
        print(f"CUDA graph capture: {doc['capture_seconds']} s")
    print(f"codes equal across paths: {doc['codes_equal_across_paths']}; {doc['seconds']} s; "
          f"load average {doc['loadavg_start']} -> {doc['loadavg_end']}")


if __name__ == "__main__":
    main()
