"""Qwen-Image text-to-image as an omni Engine (engine name `qwen_image`), on diffusers' own modules.

One stage runs the whole model: the Qwen2.5-VL text encoder once per request at admission, then the
MMDiT denoising loop, then the VAE decode. Request contract: `text` (the prompt; the engine applies
Qwen-Image's encoder template) or `prompt_token_ids` (the encoder's whole input, template included, as an
upstream AR stage would hand it over), and `image` (omni.engines.base.ImageParams). Output: one
`tensors["image"]` uint8 [n, height, width, 3] when the request finishes.

A step is one denoising step of a batch: the rows of requests of equal image size (the oldest waiting
request's size first, up to `max_batch_rows` rows, each request whole) share one transformer forward
(and one more for the unconditional rows of requests with guidance), whatever step each request is at
(timesteps go per row; each request keeps its own scheduler). Prompts of unequal length are padded and
masked. A request alone in its batch computes exactly what diffusers' QwenImagePipeline computes for the
same arguments (tests/unit/test_qwen_image.py); in a bigger batch float32 matmuls round differently.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from omni.engines.base import EngineError, EngineRequest
from omni.engines.diffusion import DiffusionEngine, Job


class QwenImageEngine(DiffusionEngine):
    name = "qwen_image"

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", dtype: str = "float32",
                 threads: int | None = None, max_batch_rows: int = 8, max_sequence_length: int = 512,
                 max_pixels: int = 1024 * 1024 * 4, max_steps: int = 200, encode_cache: int = 16, pipeline=None):
        """`encode_cache`: prompt encodings kept (most recently used; the default negative prompt " " is
        in nearly every request). `pipeline`: a QwenImagePipeline built in memory (benchmarks at real
        size); model_dir unused then."""
        if not 1 <= max_sequence_length <= 1024:
            raise ValueError(f"max_sequence_length must be in [1, 1024] (Qwen-Image's), got {max_sequence_length}")
        super().__init__(model_dir, device=device, dtype=dtype, threads=threads, max_batch_rows=max_batch_rows,
                         encode_cache=encode_cache, pipeline=pipeline)
        if self.pipe.transformer.config.guidance_embeds:
            raise ValueError("a guidance-distilled Qwen-Image transformer (guidance_embeds) is not supported")
        self.max_sequence_length = max_sequence_length
        self.max_pixels, self.max_steps = max_pixels, max_steps
        # Sizes must be whole latent patches: the VAE's downsampling times the DiT's patch size.
        self.size_multiple = self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size

    def pipeline_class(self) -> type:
        from diffusers import QwenImagePipeline

        return QwenImagePipeline

    # -- requests --------------------------------------------------------------------

    def make_job(self, request: EngineRequest) -> Job:
        if request.prompt_token_ids is None and request.text is None:
            raise EngineError(f"{self.name}: request {request.request_id} has neither text nor prompt_token_ids")
        ids = list(request.prompt_token_ids) if request.prompt_token_ids is not None else None
        drop = self.pipe.prompt_template_encode_start_idx
        most = self.pipe.tokenizer_max_length + drop     # what the pipeline's tokenizer call truncates to
        if ids is not None and not drop < len(ids) <= most:
            raise EngineError(f"prompt_token_ids: {len(ids)} ids; Qwen-Image's encoder input (template included) "
                              f"takes {drop + 1} to {most}")
        return Job(request.request_id, request.image, ids, request.text)

    # -- the three parts of a request --------------------------------------------------

    def token_ids(self, text: str) -> list[int]:
        """The encoder's input for a prompt: Qwen-Image's template, tokenized as its pipeline does."""
        pipe = self.pipe
        drop = pipe.prompt_template_encode_start_idx
        enc = pipe.tokenizer(pipe.prompt_template_encode.format(text), max_length=pipe.tokenizer_max_length + drop,
                             truncation=True)
        return list(enc.input_ids)

    def encode(self, ids: list[int]) -> torch.Tensor:
        """[1, tokens, dim]: the encoder's last hidden state past the template's system part. A prompt is
        encoded alone, so a cached encoding is the same tensor a new one would be."""
        def run() -> torch.Tensor:
            pipe = self.pipe
            x = torch.tensor([ids], device=self.device)
            out = pipe.text_encoder(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True)
            rows = out.hidden_states[-1][:, pipe.prompt_template_encode_start_idx:]
            return rows[:, :self.max_sequence_length].to(pipe.text_encoder.dtype)

        return self.cached(tuple(ids), run)

    def admit(self, job: Job) -> None:
        """Encode the prompt (and the negative one with guidance), draw the noise, set the schedule."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        pipe, p = self.pipe, job.params
        t0 = time.monotonic()
        ids = job.ids if job.ids is not None else self.token_ids(job.text or "")
        job.embeds = self.encode(ids).repeat(p.n, 1, 1)
        if p.guidance_scale > 1 and p.negative_prompt is not None:
            job.neg_embeds = self.encode(self.token_ids(p.negative_prompt)).repeat(p.n, 1, 1)
        self._stats["encode_s"] += time.monotonic() - t0
        channels = pipe.transformer.config.in_channels // 4
        gen = torch.Generator(device="cpu").manual_seed(p.seed)
        job.latents = pipe.prepare_latents(p.n, channels, p.height, p.width, job.embeds.dtype, self.device, gen)
        cfg = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
        steps = p.num_inference_steps
        c = cfg.config
        mu = calculate_shift(job.latents.shape[1], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        job.timesteps, _ = retrieve_timesteps(cfg, steps, self.device, sigmas=np.linspace(1.0, 1 / steps, steps),
                                              mu=mu)
        cfg.set_begin_index(0)
        job.scheduler = cfg
        job.ids = None

    def denoise(self, batch: list[Job]) -> None:
        """One step of every job in the batch: one conditional forward for all rows, one unconditional
        forward for the rows with guidance, then each job's own scheduler step."""
        pipe = self.pipe
        p = batch[0].params
        shape = (1, p.height // pipe.vae_scale_factor // 2, p.width // pipe.vae_scale_factor // 2)
        latents = torch.cat([j.latents for j in batch])
        t = torch.cat([j.timesteps[j.done].expand(j.params.n) for j in batch]).to(latents.dtype)
        cond = self.forward(latents, t, [j.embeds for j in batch], shape, "cond")
        guided, rows = self.guided(batch)
        uncond = None
        if guided:
            uncond = self.forward(latents[rows], t[rows], [batch[i].neg_embeds for i in guided], shape, "uncond")
        self.scheduler_steps(batch, cond, uncond, guide)

    def forward(self, latents: torch.Tensor, t: torch.Tensor, embeds: list[torch.Tensor], shape: tuple,
                context: str) -> torch.Tensor:
        """The DiT on a batch; prompts of unequal length padded with zeros and masked (none: no mask,
        as the pipeline passes a prompt alone)."""
        longest = max(e.shape[1] for e in embeds)
        mask = None
        if any(e.shape[1] != longest for e in embeds):
            mask = torch.cat([torch.arange(longest, device=self.device).expand(e.shape[0], longest) < e.shape[1]
                              for e in embeds]).long()
            embeds = [torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e in embeds]
        with self.pipe.transformer.cache_context(context):
            return self.pipe.transformer(hidden_states=latents, timestep=t / 1000, guidance=None,
                                         encoder_hidden_states_mask=mask, encoder_hidden_states=torch.cat(embeds),
                                         img_shapes=[[shape]] * latents.shape[0], attention_kwargs={},
                                         return_dict=False)[0]

    def decode(self, jobs: list[Job]) -> list[torch.Tensor]:
        """One VAE decode for the finished jobs (of one size): uint8 [n, height, width, 3] each, as the
        pipeline's PIL images hold them."""
        pipe, p = self.pipe, jobs[0].params
        latents = torch.cat([j.latents for j in jobs])
        image = self.vae_decode(pipe._unpack_latents(latents, p.height, p.width, pipe.vae_scale_factor))[:, :, 0]
        rows = np.stack([np.asarray(im) for im in pipe.image_processor.postprocess(image, output_type="pil")])
        return self.split(rows, jobs)


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's true classifier-free guidance: the guided prediction rescaled to the conditional
    one's norm (per token)."""
    comb = uncond + scale * (cond - uncond)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
