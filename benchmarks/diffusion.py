"""Images served by omni (`omni serve DIR`, POST /v1/images/generations) vs diffusers'
QwenImagePipeline called in this process, at concurrency 1 and 4.

Default: the tiny Qwen-Image folder (omni/models/qwen_image/tiny.py, built in a temp dir) on CPU,
float32, one thread on each side. The pipeline serves one request a call, so at concurrency 4 its
requests run one after another; omni's stage batches the four requests' denoising steps into one
DiT forward (their text encodings and VAE decodes stay one per request). A third row, `pipeline
x4`, is the pipeline given the four prompts as one list (its own batch: the best an in-process
caller who holds all four at once can do). Sides take turns burst by burst, each first in turn, so a
change in the shared machine's load hits both; one warm-up request each is not reported.

Figures per side and level: images/s (images over the bursts' wall time), latency p50 (a request's
time from send to its image), s/step (latency over denoising steps: what one step costs a request);
per level the paired figure: the median over bursts of the pipeline's burst time over omni's (> 1: omni is
faster), steadier than the totals on a shared machine.

    .venv/bin/python benchmarks/diffusion.py            # --quick, under 2 minutes
    .venv/bin/python benchmarks/diffusion.py --full     # more bursts
    .venv/bin/python benchmarks/diffusion.py --json     # one JSON document
    .venv/bin/python benchmarks/diffusion.py --device cuda --real-size   # the real-size DiT, see below

`--real-size` builds Qwen-Image's real transformer (60 blocks, width 3072; `--layers` fewer) and VAE
from their configs with random weights on the device (bfloat16, no download, nothing on disk) and a
one-layer text encoder of the real width (3584; the text encoder runs once per request, the
benchmark is about the denoising loop). There is no folder to serve, so omni's side is the
qwen_image engine stepped in this process (the stage's loop without processes and HTTP) against the
pipeline on the same modules.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["a red cat on the mountain", "the big dog runs home over the hill", "sun over the sea at night",
           "a green tree beside the river"]


class InProcess:
    """The pipeline called in this process, one request a call (or the whole burst as one list)."""

    def __init__(self, pipe, args):
        self.pipe, self.a = pipe, args

    def call(self, prompts: list[str], seeds: list[int]) -> None:
        import torch

        self.pipe(prompts if len(prompts) > 1 else prompts[0], negative_prompt=[" "] * len(prompts)
                  if len(prompts) > 1 else " ", true_cfg_scale=4.0, width=self.a.size, height=self.a.size,
                  num_inference_steps=self.a.steps,
                  generator=[torch.Generator().manual_seed(s) for s in seeds] if len(seeds) > 1
                  else torch.Generator().manual_seed(seeds[0]))

    def burst(self, prompts: list[str], seeds: list[int], together: bool = False) -> list[float]:
        t0 = time.perf_counter()
        if together:
            self.call(prompts, seeds)
            return [time.perf_counter() - t0] * len(prompts)
        done = []
        for p, s in zip(prompts, seeds):
            self.call([p], [s])
            done.append(time.perf_counter() - t0)   # a request waits for those before it
        return done


class Served:
    def __init__(self, url: str, args):
        self.url, self.a = url, args
        self.client = None      # one kept-alive client for the run (made on the benchmark's loop)

    async def burst(self, prompts: list[str], seeds: list[int]) -> list[float]:
        import httpx

        self.client = self.client or httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=8))

        async def one(p, s):
            t0 = time.perf_counter()
            r = await self.client.post(f"{self.url}/v1/images/generations",
                                       json={"prompt": p, "seed": s, "size": f"{self.a.size}x{self.a.size}",
                                             "num_inference_steps": self.a.steps, "guidance_scale": 4.0})
            r.raise_for_status()
            return time.perf_counter() - t0
        return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds))))


class EngineSide:
    """The qwen_image engine stepped in this process (--real-size: nothing to serve)."""

    def __init__(self, pipe, args, encode_cache: int):
        from omni.models.qwen_image.engine import QwenImageEngine

        self.engine = QwenImageEngine(None, device=args.device, pipeline=pipe, max_pixels=args.size ** 2,
                                      encode_cache=encode_cache)
        self.a, self.n = args, 0

    async def burst(self, prompts: list[str], seeds: list[int]) -> list[float]:
        from omni.engines.base import EngineRequest, ImageParams

        t0 = time.perf_counter()
        done = {}
        for p, s in zip(prompts, seeds):
            self.n += 1
            self.engine.add_request(EngineRequest(request_id=f"r{self.n}", text=p, image=ImageParams(
                width=self.a.size, height=self.a.size, num_inference_steps=self.a.steps, guidance_scale=4.0,
                negative_prompt=" ", seed=s)))
        while self.engine.has_unfinished():
            for o in self.engine.step():
                done[o.request_id] = time.perf_counter() - t0
        return list(done.values())


def row(side: str, level: int, lat: list[float], wall: float, steps: int) -> dict:
    return {"side": side, "concurrency": level, "images": len(lat), "images_per_s": round(len(lat) / wall, 3),
            "latency_s_p50": round(statistics.median(lat), 3),
            "s_per_step": round(statistics.mean(lat) / steps, 4)}


async def measure(omni_side, pipe_side: InProcess, omni_name: str, levels: list[tuple[int, int]], steps: int):
    """Rows per side and level, and per level the paired figure: the median over bursts of the
    pipeline's burst time over omni's (the same prompts and seeds back to back; > 1: omni is faster),
    which a change in the machine's load between bursts moves far less than the totals."""
    rows, paired, seed = [], [], 0
    for _ in range(2):                            # warm-ups (the second on a kept-alive connection)
        await omni_side.burst(PROMPTS[:1], [0])
        pipe_side.burst(PROMPTS[:1], [0])
    for level, bursts in levels:
        lat: dict[str, list[float]] = {omni_name: [], "pipeline": [], "pipeline x4": []}
        walls: dict[str, list[float]] = {side: [] for side in lat}
        for b in range(bursts):
            prompts = [PROMPTS[(b + i) % len(PROMPTS)] for i in range(level)]
            seeds = list(range(seed, seed + level))
            seed += level
            order = [omni_name, "pipeline"] if b % 2 == 0 else ["pipeline", omni_name]
            if level > 1:
                order.append("pipeline x4")
            for side in order:
                t0 = time.perf_counter()
                if side == omni_name:
                    got = await omni_side.burst(prompts, seeds)
                else:
                    got = pipe_side.burst(prompts, seeds, together=side == "pipeline x4")
                walls[side].append(time.perf_counter() - t0)
                lat[side] += got
        for side in lat:
            if lat[side]:
                rows.append(row(side, level, lat[side], sum(walls[side]), steps))
        paired.append({"concurrency": level, "bursts": bursts, "pipeline_over_omni_burst_time_p50": round(
            statistics.median(p / o for p, o in zip(walls["pipeline"], walls[omni_name])), 3)})
    return rows, paired


def ratios(rows: list[dict], paired: list[dict], omni_name: str) -> list[dict]:
    out = []
    for level, pair in zip(sorted({r["concurrency"] for r in rows}), paired):
        by = {r["side"]: r for r in rows if r["concurrency"] == level}
        out.append({**pair, "images_per_s_omni_over_pipeline": round(by[omni_name]["images_per_s"] /
                                                                      by["pipeline"]["images_per_s"], 3)})
    return out


COLS = ["side", "concurrency", "images", "images_per_s", "latency_s_p50", "s_per_step"]
HEAD = ["side", "conc", "images", "images/s", "lat p50 s", "s/step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: a short run (< 2 min)")
    mode.add_argument("--full", action="store_true", help="more bursts per level")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--model", help="a Qwen-Image diffusers folder (default: the tiny one, built in a temp dir)")
    ap.add_argument("--size", type=int, default=None, help="image width and height (default 128; real size 512)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default 10)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--real-size", action="store_true", help="Qwen-Image's real DiT and VAE, random weights, "
                    "built on --device; omni's side is the engine in this process")
    ap.add_argument("--layers", type=int, default=60, help="--real-size: DiT blocks (Qwen-Image has 60)")
    ap.add_argument("--no-encode-cache", action="store_true", help="omni encodes every prompt, as the pipeline "
                    "does (engine arg encode_cache: 0; by default the negative prompt's encoding is reused)")
    a = ap.parse_args()
    a.size = a.size or (512 if a.real_size else 128)
    a.steps = a.steps or 10
    if a.real_size and a.device == "cpu":
        ap.error("--real-size needs --device cuda (the real DiT is 20 B parameters)")
    levels = [(1, 48), (4, 12)] if a.full else [(1, 24), (4, 6)]

    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    server = None
    try:
        if a.real_size:
            from benchmarks.real_size import qwen_image_pipeline

            pipe = qwen_image_pipeline(a.device, a.layers)
            omni_name, omni_side = "omni engine", EngineSide(pipe, a, 0 if a.no_encode_cache else 16)
        else:
            from diffusers import QwenImagePipeline

            from omni.models.qwen_image.tiny import build
            from tests.e2e.harness import OmniProcess, omni_env

            folder = a.model or str(build(Path(tempfile.mkdtemp(prefix="qwen-image-tiny-"))))
            extra = ("--stage-overrides", json.dumps({"0": {"encode_cache": 0}})) if a.no_encode_cache else ()
            server = OmniProcess("serve", folder, "--port", "0", *extra,
                                 env=omni_env(OMNI_PLATFORM=a.device, OMP_NUM_THREADS="1"))
            pipe = QwenImagePipeline.from_pretrained(folder, dtype=torch.float32)
            pipe.set_progress_bar_config(disable=True)
            omni_name, omni_side = "omni", Served(server.http(600), a)
        startup_s = round(time.perf_counter() - t0, 1)
        rows, paired = asyncio.run(measure(omni_side, InProcess(pipe, a), omni_name, levels, a.steps))
    finally:
        if server is not None:
            server.interrupt(60)
    doc = {"model": "Qwen-Image real size (random weights)" if a.real_size else (a.model or "tiny Qwen-Image"),
           "encode_cache": not a.no_encode_cache, "device": a.device, "size": f"{a.size}x{a.size}",
           "steps": a.steps, "guidance_scale": 4.0,
           "startup_seconds": startup_s, "rows": rows, "ratios": ratios(rows, paired, omni_name),
           "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "seconds": round(time.perf_counter() - t0, 1)}
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{doc['model']} on {a.device}, {doc['size']}, {a.steps} steps, guidance 4.0 "
          f"(load {load_start} -> {doc['loadavg_end']}, {doc['seconds']} s)")
    from benchmarks.audio import table

    print(table(rows, COLS, HEAD))
    for r in doc["ratios"]:
        print(f"concurrency {r['concurrency']}: {omni_name} / pipeline images/s = "
              f"{r['images_per_s_omni_over_pipeline']}; paired (pipeline / {omni_name} burst time, "
              f"p50 of {r['bursts']}) = {r['pipeline_over_omni_burst_time_p50']}")


if __name__ == "__main__":
    main()
