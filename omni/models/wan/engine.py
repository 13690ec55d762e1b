"""Wan text-to-video as an omni Engine (engine name `wan`), on diffusers' own modules.

One stage runs the whole model: the UMT5 text encoder once per prompt at admission, then the
WanTransformer3DModel denoising loop, then the AutoencoderKLWan decode. Request contract: `text` (the
prompt) and `image` (omni.engines.base.ImageParams with `num_frames`). Output: one `tensors["video"]`
uint8 [n, frames, height, width, 3] when the request finishes (the pipeline's output_type "np" frames,
x 255 rounded, as diffusers turns them into PIL images).

A step is one denoising step of a batch: the rows of requests of equal shape (size and frames; with
Wan2.2's two transformers also the same one at this step) share one transformer forward, and one more
for the rows with guidance, whatever step each request is at (the timestep goes per row; each request
keeps its own UniPC scheduler, whose multistep history is the request's). Wan pads every prompt to
`max_sequence_length` with zeros and passes no mask, so prompts batch without padding of their own. A
request alone in its batch computes exactly what diffusers' WanPipeline computes for the same arguments
(tests/unit/test_wan.py); in a bigger batch float32 matmuls round differently.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omni.engines.base import EngineError, EngineRequest, ImageParams
from omni.engines.diffusion import DiffusionEngine, Job


class WanEngine(DiffusionEngine):
    name = "wan"
    unit = "video"

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", dtype: str = "float32",
                 threads: int | None = None, max_batch_rows: int = 4, max_sequence_length: int = 512,
                 max_pixels: int = 1280 * 720, max_frames: int = 81, max_steps: int = 200, encode_cache: int = 16,
                 pipeline=None):
        """`max_pixels`: of one frame; `max_frames`: frames a video. `max_sequence_length`: the prompt's
        padded length (WanPipeline's default, 512: its output depends on it). `pipeline`: a WanPipeline
        built in memory; model_dir unused then."""
        super().__init__(model_dir, device=device, dtype=dtype, threads=threads, max_batch_rows=max_batch_rows,
                         encode_cache=encode_cache, pipeline=pipeline)
        pipe = self.pipe
        if pipe.transformer is None:
            raise ValueError("a Wan folder without `transformer` (only transformer_2) is not supported")
        if pipe.config.expand_timesteps:
            raise ValueError("Wan2.2 TI2V (expand_timesteps) is not supported: text-to-video Wan2.1/2.2 T2V only")
        if pipe.transformer.config.image_dim is not None:
            raise ValueError("an image-to-video Wan transformer (image_dim) is not supported: text-to-video only")
        self.max_sequence_length = max_sequence_length
        self.max_pixels, self.max_frames, self.max_steps = max_pixels, max_frames, max_steps
        patch = pipe.transformer.config.patch_size
        # Sizes must be whole latent patches, frames whole latent frames (plus the first).
        self.size_multiple = pipe.vae_scale_factor_spatial * max(patch[1], patch[2])
        self.frame_multiple = pipe.vae_scale_factor_temporal
        # The transformer's rotary table has rope_max_seq_len positions per axis: a latent longer than that
        # (in patches) fails the forward, and with it the whole batch.
        self.rope_positions = pipe.transformer.config.rope_max_seq_len
        self.max_width = self.rope_positions * pipe.vae_scale_factor_spatial * patch[2]
        self.max_height = self.rope_positions * pipe.vae_scale_factor_spatial * patch[1]
        self.rope_frames = self.rope_positions * patch[0]     # latent frames the table covers
        ratio = pipe.config.boundary_ratio
        # Wan2.2 A14B: `transformer` above this timestep, `transformer_2` below (the pipeline's rule).
        self.boundary = None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps

    def pipeline_class(self) -> type:
        from diffusers import WanPipeline

        return WanPipeline

    # -- requests --------------------------------------------------------------------

    def check(self, p: ImageParams) -> None:
        super().check(p)
        f = self.frame_multiple
        if not 1 <= p.num_frames <= self.max_frames or (p.num_frames - 1) % f:
            raise EngineError(f"num_frames must be 1 more than a multiple of {f}, at most {self.max_frames}; "
                              f"got {p.num_frames}")
        if p.width > self.max_width or p.height > self.max_height:
            raise EngineError(f"size {p.width}x{p.height}: the width is at most {self.max_width} and the height at "
                              f"most {self.max_height} pixels (the transformer's rotary table: rope_max_seq_len "
                              f"{self.rope_positions} positions a side)")
        if (p.num_frames - 1) // f + 1 > self.rope_frames:
            raise EngineError(f"num_frames {p.num_frames}: at most {(self.rope_frames - 1) * f + 1} (the "
                              f"transformer's rotary table: rope_max_seq_len {self.rope_positions})")

    def make_job(self, request: EngineRequest) -> Job:
        if request.text is None:
            raise EngineError(f"{self.name}: request {request.request_id} has no text (Wan's encoder takes the "
                              "prompt's text, not token ids)")
        return Job(request.request_id, request.image, None, request.text)

    def batch_key(self, job: Job) -> tuple:
        p = job.params
        return (p.width, p.height, p.num_frames, self.second(job))

    def second(self, job: Job) -> bool:
        """Whether the job's next step runs on Wan2.2's low-noise `transformer_2`."""
        if self.boundary is None or job.timesteps is None:
            return False
        return bool(job.timesteps[job.done] < self.boundary)

    # -- the three parts of a request --------------------------------------------------

    def encode(self, text: str) -> torch.Tensor:
        """[1, max_sequence_length, dim]: the pipeline's own prompt encoding (cleaned, padded with zeros)."""
        pipe = self.pipe

        def run() -> torch.Tensor:
            rows = pipe._get_t5_prompt_embeds(prompt=text, num_videos_per_prompt=1,
                                              max_sequence_length=self.max_sequence_length, device=self.device)
            return rows.to(pipe.transformer.dtype)

        return self.cached(text, run)

    def admit(self, job: Job) -> None:
        """Encode the prompt (and the negative one with guidance), draw the noise, set the schedule."""
        pipe, p = self.pipe, job.params
        job.embeds = self.encode(job.text or "").repeat(p.n, 1, 1)
        if p.guidance_scale > 1:      # the pipeline's rule; its negative prompt defaults to ""
            job.neg_embeds = self.encode(p.negative_prompt or "").repeat(p.n, 1, 1)
        gen = torch.Generator(device="cpu").manual_seed(p.seed)
        job.latents = pipe.prepare_latents(p.n, pipe.transformer.config.in_channels, p.height, p.width, p.num_frames,
                                           torch.float32, self.device, gen)
        sched = type(pipe.scheduler).from_config(pipe.scheduler.config)
        sched.set_timesteps(p.num_inference_steps, device=self.device)
        sched.set_begin_index(0)
        job.scheduler, job.timesteps = sched, sched.timesteps

    def denoise(self, batch: list[Job]) -> None:
        """One step of every job in the batch: one conditional forward for all rows, one unconditional
        forward for the rows with guidance, then each job's own scheduler step."""
        model = self.pipe.transformer_2 if self.second(batch[0]) else self.pipe.transformer
        latents = torch.cat([j.latents for j in batch])
        x = latents.to(model.dtype)
        t = torch.cat([j.timesteps[j.done].expand(j.params.n) for j in batch])
        with model.cache_context("cond"):
            cond = model(hidden_states=x, timestep=t, encoder_hidden_states=torch.cat([j.embeds for j in batch]),
                         attention_kwargs=None, return_dict=False)[0]
        guided, rows = self.guided(batch)
        uncond = None
        if guided:
            with model.cache_context("uncond"):
                uncond = model(hidden_states=x[rows], timestep=t[rows], attention_kwargs=None, return_dict=False,
                               encoder_hidden_states=torch.cat([batch[i].neg_embeds for i in guided]))[0]
        self.scheduler_steps(batch, cond, uncond, guide)

    def decode(self, jobs: list[Job]) -> list[torch.Tensor]:
        """One VAE decode for the finished jobs (of one shape): uint8 [n, frames, height, width, 3] each."""
        video = self.vae_decode(torch.cat([j.latents for j in jobs]))
        return self.split(to_uint8(self.pipe.video_processor.postprocess_video(video, output_type="np")), jobs)


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance as WanPipeline applies it (Wan2.2's guidance_scale_2 is the pipeline's
    default there, guidance_scale: one scale for both transformers)."""
    return uncond + scale * (cond - uncond)


def to_uint8(frames):
    """The pipeline's float frames in [0, 1] as 8-bit, rounded as diffusers' numpy_to_pil rounds."""
    return (frames * 255).round().astype("uint8")
