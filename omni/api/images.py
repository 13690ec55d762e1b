"""/v1/images/generations: a prompt in, PNG images (base64) out, as OpenAI answers.

The deployment's bounds (config `pipeline.images`) are checked here, each refusal a 400 naming the
parameter; the diffusion stage checks them again against what its model can make. Defaults fill what
the client left out, so the stage gets every field set (omni.engines.base.ImageParams). PNG encoding
runs off the event loop.

An AR -> DiT pipeline (config `pipeline.images.expand`): the client's prompt goes into the deploy's chat
(system, user), rendered with the LM's chat template here and sent to stage 0 as token ids under that
stage's deploy sampling; the DiT renders what the LM writes, which each answer item reports as
`revised_prompt` (OpenAI's DALL-E 3 name for it).
"""

from __future__ import annotations

import base64
import io
import re
import secrets
import time
import uuid
from typing import AsyncIterator

import anyio
import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni import latency_trace
from omni.api import protocol as P
from omni.api.errors import APIError, bad_request
from omni.api.http import until_disconnect
from omni.api.protocol_media import WXH
from omni.api.state import OFFLOAD_CHARS, FrontendState
from omni.config import ImageSettings, VideoSettings
from omni.engines.base import ImageParams
from omni.orchestrator.types import OrchestratorLike, PipelineOutput, PipelineRequest

ROUTE = "/v1/images/generations"


_WXH = re.compile(WXH)


def parse_size(size: str, param: str = "size", auto: str | None = None) -> tuple[int, int]:
    """"WxH" -> (W, H); "auto" (OpenAI's images) is `auto` where given, the deployment's default size."""
    if size == "auto" and auto is not None:
        size = auto
    if _WXH.fullmatch(size) is None:
        shown = size if len(size) <= 32 else size[:32] + "..."
        raise bad_request(f"size must be WIDTHxHEIGHT{' or auto' if auto else ''} (e.g. 1024x1024), not `{shown}`",
                          param=param)
    width, _, height = size.partition("x")
    return int(width), int(height)


def check_prompt(prompt: str, s: ImageSettings | VideoSettings) -> None:
    if not prompt.strip() or "\x00" in prompt:
        raise bad_request("prompt must have some text and no NUL character", param="prompt")
    if len(prompt) > s.max_prompt_chars:
        raise bad_request(f"prompt is {len(prompt)} characters; the limit is {s.max_prompt_chars}", param="prompt")


def check_size(width: int, height: int, s: ImageSettings | VideoSettings, param: str = "size") -> None:
    m = s.size_multiple
    if width < m or height < m or width % m or height % m:
        raise bad_request(f"size {width}x{height}: width and height must be multiples of {m} (the model's VAE "
                          "scale times its patch size)", param=param)
    if width * height > s.max_pixels:
        raise bad_request(f"size {width}x{height} is {width * height} pixels; the limit is {s.max_pixels}",
                          param=param)


def denoising(req: P.ImageGenerationRequest | P.VideoCreateRequest, s: ImageSettings | VideoSettings) -> dict:
    """Steps, guidance, negative prompt and seed: the client's within the bounds, else the deployment's."""
    steps = req.num_inference_steps if req.num_inference_steps is not None else s.default_steps
    if steps > s.max_steps:
        raise bad_request(f"num_inference_steps is {steps}; the limit is {s.max_steps}", param="num_inference_steps")
    scale = req.guidance_scale if req.guidance_scale is not None else s.default_guidance_scale
    negative = req.negative_prompt
    if negative is not None and scale <= 1:
        raise bad_request(f"negative_prompt needs guidance: guidance_scale is {scale} (guidance is on above 1)",
                          param="negative_prompt")
    if negative is None and scale > 1:
        negative = s.default_negative_prompt
    if negative is not None and len(negative) > s.max_prompt_chars:
        raise bad_request(f"negative_prompt is {len(negative)} characters; the limit is {s.max_prompt_chars}",
                          param="negative_prompt")
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    return dict(num_inference_steps=steps, guidance_scale=scale, negative_prompt=negative, seed=seed)


def image_params(req: P.ImageGenerationRequest, s: ImageSettings) -> ImageParams:
    """The request's image parameters over the deployment's defaults, within its bounds."""
    if req.response_format != "b64_json":
        raise bad_request(f"response_format `{req.response_format}` is not supported: omni returns the images "
                          "in the response (b64_json), it keeps no files to link to", param="response_format")
    if req.output_format not in (None, "png"):
        raise bad_request(f"output_format `{req.output_format}` is not supported: omni returns PNG images",
                          param="output_format")
    if req.true_cfg_scale is not None:    # vllm-omni's name for Qwen-Image's guidance (denoising reads guidance_scale)
        if req.guidance_scale is not None and req.guidance_scale != req.true_cfg_scale:
            raise bad_request(f"guidance_scale {req.guidance_scale} and true_cfg_scale {req.true_cfg_scale} differ: "
                              "here both name Qwen-Image's true classifier-free guidance scale; give one",
                              param="true_cfg_scale")
        req = msgspec.structs.replace(req, guidance_scale=req.true_cfg_scale)
    check_prompt(req.prompt, s)
    width, height = parse_size(s.default_size if req.size is None else req.size, auto=s.default_size)
    check_size(width, height, s)
    n = req.n if req.n is not None else 1
    if n > s.max_n:
        raise bad_request(f"n is {n}; the limit is {s.max_n} images a request", param="n")
    return ImageParams(width=width, height=height, n=n, **denoising(req, s))


def png_b64(out: PipelineOutput) -> list[str]:
    """Each image as base64 PNG. zlib level 1: lossless like any level, and half the time of the default 6
    (5.5 -> 2.7 ms for a 128x128 image here, more than the rest of the frontend's share of a request)."""
    rows = np.frombuffer(out.image, dtype=np.uint8).reshape(out.image_shape)
    from PIL import Image

    encoded = []
    for row in rows:
        buf = io.BytesIO()
        Image.fromarray(row).save(buf, format="PNG", compress_level=1)
        encoded.append(base64.b64encode(buf.getvalue()).decode())
    return encoded


async def media_outputs(orch: OrchestratorLike, preq: PipelineRequest, modality: str) -> AsyncIterator[PipelineOutput]:
    """The request's outputs that carry its `modality`'s frames, as they come. The orchestrator's iterator
    is closed at the end, shielded, so a disconnect's cancel still aborts the request in every stage."""
    it = aiter(orch.generate(preq))
    try:
        async for out in it:
            if out.modality == modality and out.image:
                yield out
    finally:
        with anyio.CancelScope(shield=True):
            await it.aclose()


class ImageRoutes:
    def __init__(self, fe: FrontendState, settings: ImageSettings | None):
        self.fe = fe
        self.settings = settings     # None: this pipeline makes no images

    def parse(self, body: bytes) -> tuple[P.ImageGenerationRequest, ImageParams]:
        """The request and its parameters, or the 400/404 this route answers; a job checks its body here too."""
        if self.settings is None:
            raise APIError(404, "this pipeline makes no images (no stage with final_output_type image)",
                           type="not_found_error")
        req = P.decode_body(body, P.ImageGenerationRequest)
        self.fe.check_model(req.model)
        return req, image_params(req, self.settings)

    async def check(self, body: bytes) -> None:
        """What the route refuses before running (a job's create): the parse, then the LM's (`expand`)."""
        await self.pipeline_request(*self.parse(body))

    async def generations(self, request: Request) -> Response:
        req, params = self.parse(await request.body())
        preq = await self.pipeline_request(req, params)
        t0 = self.fe.t0(request)

        async def work() -> Response:
            if latency_trace.on():
                latency_trace.mark("arrived", preq.request_id, at=t0)
            images: list[str] = []
            revised: str | None = None
            async for out in media_outputs(self.fe.orch, preq, "image"):
                revised = out.prompt
                self.fe.metrics.first_output(ROUTE, time.monotonic() - t0)
                if latency_trace.on():
                    latency_trace.mark("image", preq.request_id, params.n)
                images += await anyio.to_thread.run_sync(png_b64, out)
                if latency_trace.on():
                    latency_trace.mark("png", preq.request_id, params.n)
            if len(images) != params.n:
                raise APIError(500, f"the pipeline made {len(images)} of {params.n} images", type="stage_error")
            extra = {"revised_prompt": revised} if revised is not None else {}
            return JSONResponse({"created": int(time.time()), "data": [{"b64_json": b, **extra} for b in images]})

        return await until_disconnect(request, work)

    async def pipeline_request(self, req: P.ImageGenerationRequest, params: ImageParams) -> PipelineRequest:
        """The image stage's own prompt is the client's text; with `expand`, stage 0 (an LM) gets the deploy's
        chat around it instead, and the client's text rides along (what the DiT renders if the LM writes
        nothing)."""
        rid = f"img-{uuid.uuid4().hex}"
        expand = self.settings.expand
        if expand is None:
            return PipelineRequest(request_id=rid, text=req.prompt, modalities=("image",), image=params)
        fe = self.fe
        fe.need_text()
        user = expand.user.replace("{prompt}", req.prompt)
        chars = len(expand.system) + len(user)
        fe.check_prompt_chars(chars, "prompt", "prompt")
        ids = await fe.offload(chars > OFFLOAD_CHARS, fe.render_chat,
                               [{"role": "system", "content": expand.system}, {"role": "user", "content": user}])
        sampling = fe.sampling(P.no_client_sampling(), fe.max_tokens(None, len(ids), "max_tokens", "prompt"), None)
        return PipelineRequest(request_id=rid, prompt_token_ids=ids, text=req.prompt, sampling=sampling,
                               modalities=("image",), image=params)
