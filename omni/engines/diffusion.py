"""What every diffusion stage engine shares (qwen_image, wan): requests as jobs stepped one denoising step
at a time in batches of equal shape, abort between steps, progress gauges, and sleep.

A family's engine subclasses `DiffusionEngine` and supplies the model's parts: `pipeline_class` (the
diffusers pipeline it loads), the bounds `check` enforces (`size_multiple`, `max_pixels`, `max_steps`; a
family may check more), `admit` (encode, draw the noise, set the schedule), `denoise` (one step of a
batch), `decode` (finished jobs to uint8 frames) and `batch_key` (which jobs may share a forward). The
loop, the bookkeeping and sleep live here once.
"""

from __future__ import annotations

import collections
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from omni.engines.base import Engine, EngineError, EngineOutput, EngineRequest, ImageParams
from omni.engines.offload import IdleOffload
from omni.engines.progress import mark_blocks

logger = logging.getLogger(__name__)


@dataclass
class Job:
    request_id: str
    params: ImageParams
    ids: list[int] | None               # encoder input, when the engine takes token ids; None once encoded
    text: str | None
    latents: torch.Tensor | None = None  # None until admitted
    embeds: torch.Tensor | None = None   # [n, tokens, dim]
    neg_embeds: torch.Tensor | None = None
    scheduler: object = None             # the job's own scheduler (multistep ones keep history per job)
    timesteps: torch.Tensor | None = None
    done: int = 0                        # denoising steps taken

    @property
    def cfg(self) -> bool:
        return self.neg_embeds is not None


def failed(job: Job, message: str) -> EngineOutput:
    return EngineOutput(request_id=job.request_id, finished=True, finish_reason="error", error=message)


class DiffusionEngine(Engine):
    """The loop and bookkeeping of a diffusion stage; see the module docstring for what a family supplies.
    `unit` names the output ("image", "video"): its tensor and its gauges."""

    name = "diffusion"
    unit = "image"

    def __init__(self, model_dir: str | Path, *, device: str, dtype: str, threads: int | None, max_batch_rows: int,
                 encode_cache: int, pipeline=None):
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        # Level-2 sleep reads the weights again from here; None: built in memory, nothing to reload from.
        self.model_dir = None if pipeline is not None else str(model_dir)
        self.dtype = getattr(torch, dtype)
        self.pipe = self.marked(pipeline.to(self.device) if pipeline is not None else self.load())
        self.max_batch_rows = max_batch_rows
        self.offload = IdleOffload(self.name, self.device, off=lambda: self.move_to(torch.device("cpu")),
                                   on=lambda: self.move_to(self.device))
        self._jobs: collections.OrderedDict[str, Job] = collections.OrderedDict()
        self._stats: collections.Counter = collections.Counter()
        self._encoded: collections.OrderedDict = collections.OrderedDict()   # prompt -> its encoding
        self.encode_cache = encode_cache
        self._report: dict[str, float] = {}    # load_extra(): replaced whole after each step

    # -- what a family supplies ----------------------------------------------------------
    # Also set by a family's __init__: size_multiple, max_pixels, max_steps (what `check` bounds).

    def pipeline_class(self) -> type:
        """The diffusers pipeline class `load` reads a folder with."""
        raise NotImplementedError

    def make_job(self, request: EngineRequest) -> Job:
        raise NotImplementedError

    def admit(self, job: Job) -> None:
        raise NotImplementedError

    def denoise(self, batch: list[Job]) -> None:
        raise NotImplementedError

    def decode(self, jobs: list[Job]) -> list[torch.Tensor]:
        raise NotImplementedError

    def batch_key(self, job: Job) -> tuple:
        return (job.params.width, job.params.height)

    # -- shared parts --------------------------------------------------------------------

    def load(self):
        pipe = self.pipeline_class().from_pretrained(self.model_dir, dtype=self.dtype)
        pipe.set_progress_bar_config(disable=True)
        return pipe.to(self.device)

    def marked(self, pipe):
        """`pipe` with a progress mark after each block of its models (the text encoder, the DiT, the VAE): on
        CPU one encoder pass or denoising step can outlast pipeline.loop_stall_s while it moves."""
        for part in getattr(pipe, "components", {}).values():
            mark_blocks(part, self.progressed)
        return pipe

    def check(self, p: ImageParams) -> None:
        """Refuse what the model cannot make, naming the parameter (the frontend checks first)."""
        m = self.size_multiple
        if p.width <= 0 or p.height <= 0 or p.width % m or p.height % m:
            raise EngineError(f"size {p.width}x{p.height}: width and height must be positive multiples of {m}")
        if p.width * p.height > self.max_pixels:
            raise EngineError(f"size {p.width}x{p.height} is {p.width * p.height} pixels; the limit is {self.max_pixels}")
        if not 1 <= p.num_inference_steps <= self.max_steps:
            raise EngineError(f"num_inference_steps must be in [1, {self.max_steps}], got {p.num_inference_steps}")
        if not 1 <= p.n <= self.max_batch_rows:
            raise EngineError(f"n must be in [1, {self.max_batch_rows}] (max_batch_rows), got {p.n}")

    def move_to(self, device: torch.device) -> None:
        self.pipe.to(device)
        self._encoded.clear()      # cached encodings live on the device too

    def cached(self, key, encode):
        """`encode()` of a prompt, kept for the `encode_cache` most recently used prompts. A prompt is
        encoded alone, so a cached encoding is the same tensor a new one would be."""
        hit = self._encoded.get(key)
        if hit is not None:
            self._encoded.move_to_end(key)
            self._stats["encode_cache_hits"] += 1
            return hit
        rows = encode()
        if self.encode_cache > 0:
            self._encoded[key] = rows
            while len(self._encoded) > self.encode_cache:
                self._encoded.popitem(last=False)
        return rows

    @staticmethod
    def rows(batch: list[Job], i: int) -> torch.Tensor:
        """The rows of batch[i] in the batch's concatenated tensors."""
        start = sum(j.params.n for j in batch[:i])
        return torch.arange(start, start + batch[i].params.n)

    def vae_decode(self, lat: torch.Tensor) -> torch.Tensor:
        """The VAE's decode of [b, z, frames, h, w] latents, un-normalised by its latents_mean / latents_std
        as the Qwen-Image and Wan pipelines do (their VAEs share the layout)."""
        vae = self.pipe.vae
        lat = lat.to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(lat.device, lat.dtype)
        scale = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(lat.device, lat.dtype)
        return vae.decode(lat / scale + mean, return_dict=False)[0]

    @staticmethod
    def split(rows, jobs: list[Job]) -> list[torch.Tensor]:
        """uint8 rows of a decode of `jobs` back into each job's n."""
        out, at = [], 0
        for j in jobs:
            out.append(torch.from_numpy(rows[at:at + j.params.n]))
            at += j.params.n
        return out

    def guided(self, batch: list[Job]) -> tuple[list[int], torch.Tensor | None]:
        """The jobs with guidance (their places in the batch) and their rows, for the unconditional forward."""
        which = [i for i, j in enumerate(batch) if j.cfg]
        return which, torch.cat([self.rows(batch, i) for i in which]) if which else None

    def scheduler_steps(self, batch: list[Job], cond: torch.Tensor, uncond: torch.Tensor | None, guide) -> None:
        """Each job's prediction (its rows of `cond`, guided by its rows of `uncond`: `guide(cond, uncond,
        scale)`) into its own scheduler's step."""
        at = 0
        for i, j in enumerate(batch):
            pred = cond[self.rows(batch, i)]
            if j.cfg:
                neg = uncond[at:at + j.params.n]
                at += j.params.n
                pred = guide(pred, neg, j.params.guidance_scale)
            j.latents = j.scheduler.step(pred, j.timesteps[j.done], j.latents, return_dict=False)[0]
            j.done += 1

    # -- requests --------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        p = request.image
        if p is None:
            raise EngineError(f"{self.name}: request {request.request_id} has no {self.unit} parameters")
        self.check(p)
        if request.request_id in self._jobs:
            raise EngineError(f"request id {request.request_id!r} is already in flight")
        self._jobs[request.request_id] = self.make_job(request)
        self._report = self.progress_gauges()

    def abort(self, request_id: str) -> None:
        if self._jobs.pop(request_id, None) is not None:
            self._stats["aborted"] += 1
            self._report = self.progress_gauges()

    def has_unfinished(self) -> bool:
        return bool(self._jobs)

    def num_waiting(self) -> int:
        # Read by the keep-alive thread too: from the report the loop thread replaces whole.
        return int(self._report.get(f"{self.unit}_requests_waiting", 0))

    def num_running(self) -> int:
        return sum(1 for j in self._jobs.values() if j.done > 0)

    def progress(self) -> dict[str, tuple[int, int]]:
        """Request id -> (denoising steps done, steps asked for)."""
        return {j.request_id: (j.done, j.params.num_inference_steps) for j in self._jobs.values()}

    # -- the loop ------------------------------------------------------------------

    def pick(self) -> list[Job]:
        """The oldest request's batch key, then every request of that key in arrival order that fits."""
        key = self.batch_key(next(iter(self._jobs.values())))
        batch, rows = [], 0
        for j in self._jobs.values():
            if self.batch_key(j) == key and rows + j.params.n <= self.max_batch_rows:
                batch.append(j)
                rows += j.params.n
        return batch

    def step(self) -> list[EngineOutput]:
        try:
            return self.step_batch()
        finally:
            self._report = self.progress_gauges()

    @torch.no_grad()
    def step_batch(self) -> list[EngineOutput]:
        """Admit the requests of the next batch, take one denoising step of it, decode what finished. A step
        that raises fails its batch's requests only; an error that says the engine is gone (`fatal`) is raised."""
        outputs: list[EngineOutput] = []
        batch = self.admit_batch(outputs)
        if not batch:
            return outputs
        now = time.monotonic()
        try:
            self.denoise(batch)
        except Exception as e:
            if getattr(e, "fatal", False):
                raise                # the engine is gone: the worker fails everything and stops
            # This batch's failure (a shape the model refused, out of memory), not the other requests':
            # its jobs are dropped, their steps half taken, and the stage serves on.
            logger.exception("%s: a denoising step of %s failed", self.name, [j.request_id for j in batch])
            for j in batch:
                del self._jobs[j.request_id]
            return outputs + [failed(j, f"denoising failed: {type(e).__name__}: {e}") for j in batch]
        self.progressed()        # the decode that may follow is a long forward of its own
        self._stats["steps"] += 1
        self._stats["step_rows"] += sum(j.params.n for j in batch)
        self._stats["denoise_s"] += time.monotonic() - now
        finished = [j for j in batch if j.done == j.params.num_inference_steps]
        if finished:
            outputs += self.finish(finished)
        return outputs

    def admit_batch(self, outputs: list[EngineOutput]) -> list[Job]:
        """The next batch, its new requests admitted (encoded, noise drawn): only those it takes, so a burst of
        requests neither stalls the running batch for every encoder pass nor holds every job's latents on the
        device. A request whose admission fails is dropped (its failure into `outputs`) and the batch picked
        again, so the next one takes its place."""
        tried: set[str] = set()
        while self._jobs:
            batch = self.pick()   # again after admitting: a family's batch key may read the schedule (Wan)
            fresh = [j for j in batch if j.latents is None and j.request_id not in tried]
            if not fresh:
                return batch
            for job in fresh:
                tried.add(job.request_id)
                try:
                    self.admit(job)
                    self.progressed()
                except Exception as e:
                    if getattr(e, "fatal", False):
                        raise        # the engine is gone, as in the denoising step
                    logger.exception("%s: request %s failed at admission", self.name, job.request_id)
                    del self._jobs[job.request_id]
                    outputs.append(failed(job, f"admission failed: {type(e).__name__}: {e}"))
        return []

    def finish(self, jobs: list[Job]) -> list[EngineOutput]:
        """Decode the jobs that took their last step (together: one VAE batch) and hand out their output."""
        t0 = time.monotonic()
        for j in jobs:
            del self._jobs[j.request_id]
        try:
            made = self.decode(jobs)
        except Exception as e:
            logger.exception("%s: the VAE decode of %s failed", self.name, [j.request_id for j in jobs])
            return [failed(j, f"decode failed: {type(e).__name__}: {e}") for j in jobs]
        finally:
            self._stats["decode_s"] += time.monotonic() - t0
        self._stats[f"{self.unit}s"] += sum(j.params.n for j in jobs)
        return [EngineOutput(request_id=j.request_id, tensors={self.unit: x}, finished=True, finish_reason="stop")
                for j, x in zip(jobs, made)]

    # -- sleep and figures -------------------------------------------------------------

    def can_sleep(self) -> bool:
        return self.offload.can_sleep() or self.model_dir is not None

    def can_sleep_at(self, level: int) -> bool:
        return self.offload.can_sleep() if level == 1 else self.model_dir is not None

    def sleep(self, level: int = 1) -> None:
        """Level 1: the pipeline to host memory (a GPU's only). Level 2: the weights dropped and read from
        the folder again at wake-up, as torch_lm's level 2: frees host memory on CPU too."""
        if level not in (1, 2):
            raise EngineError(f"sleep level must be 1 or 2, got {level}")
        if self.pipe is None:
            return                       # at level 2 already
        if level == 1 and not self.offload.can_sleep():
            raise EngineError(f"{self.name} on CPU cannot sleep at level 1: its weights have no device memory to "
                              "free; level 2 drops them and reads them again from the folder at wake-up")
        what = f"{self.unit} request(s) open"
        if level == 1:
            self.offload.sleep(len(self._jobs), what)
            return
        if self._jobs:
            raise EngineError(f"{self.name} cannot sleep with {len(self._jobs)} {what}")
        if self.model_dir is None:
            raise EngineError(f"{self.name} was built from a pipeline in memory: level 2 has no folder to read the "
                              "weights from again; use level 1")
        self.pipe = None
        self._encoded.clear()
        self.offload.sleeping = False    # nothing left on the host to bring back: wake-up loads
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.pipe is None:
            self.pipe = self.marked(self.load())
        self.offload.wake_up()

    def is_sleeping(self) -> bool:
        return self.offload.sleeping or self.pipe is None

    def progress_gauges(self) -> dict[str, float]:
        """Requests in flight (and those not stepped yet), their denoising steps done and left, outputs made."""
        u = self.unit
        return {f"{u}_requests": float(len(self._jobs)),
                f"{u}_requests_waiting": float(sum(1 for j in self._jobs.values() if j.done == 0)),
                f"{u}_steps_done": float(sum(j.done for j in self._jobs.values())),
                f"{u}_steps_left": float(sum(j.params.num_inference_steps - j.done for j in self._jobs.values())),
                f"{u}s_total": float(self._stats[f"{u}s"])}

    def load_extra(self) -> dict[str, float]:
        return self._report

    def stats(self) -> dict[str, float]:
        """Totals (denoising steps, rows stepped, outputs, seconds per part, cache hits) and the progress
        gauges."""
        return {**{k: float(v) for k, v in self._stats.items()}, **self.progress_gauges()}
