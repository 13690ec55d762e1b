"""OpenAI's Videos API: POST /v1/videos starts a video, GET /v1/videos lists, GET /v1/videos/{id} reads,
GET /v1/videos/{id}/content downloads the MP4, DELETE /v1/videos/{id} deletes.

A video is an async job of omni/api/jobs.py (id `video_...`): its record lives in the master's KV store
and its MP4 in the result directory the frontends share, so every frontend of `--api-server-count N`
lists, reads, downloads and deletes the same videos (vllm-omni answers these routes 409 with more than
one API server). The frontend that accepted a video runs it: the prompt to the video stage, the frames
it makes to a lossless MP4 (omni/api/mp4.py) off the event loop.

`progress` is 0 until the video is completed, then 100: the stage's per-step progress is in its gauges
(video_steps_done / video_steps_left in /metrics and `omni status`), not in the job record.
"""

from __future__ import annotations

import uuid

import anyio
import msgspec
import numpy as np
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.api import mp4
from omni.api import protocol as P
from omni.api.errors import APIError, bad_request
from omni.api.images import check_prompt, check_size, denoising, media_outputs, parse_size
from omni.api.jobs import Jobs
from omni.api.state import FrontendState
from omni.config import VideoSettings
from omni.engines.base import ImageParams
from omni.orchestrator.types import PipelineRequest

ROUTE = "/v1/videos"
PREFIX = "video_"
FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


def frames_of(req: P.VideoCreateRequest, fps: int, s: VideoSettings) -> tuple[int, str]:
    """The frames asked for (num_frames, or OpenAI's seconds at `fps` to the nearest frame count the VAE
    takes), and the parameter that said so."""
    m = s.frame_multiple
    if req.seconds is not None:
        if req.num_frames is not None:
            raise bad_request("give seconds or num_frames, not both", param="seconds")
        frames = round(max(0, round(req.seconds * fps) - 1) / m) * m + 1
        param = "seconds"
    else:
        frames = req.num_frames if req.num_frames is not None else s.default_frames
        param = "num_frames"
    if (frames - 1) % m:
        raise bad_request(f"num_frames is {frames}; it must be 1 more than a multiple of {m} (the VAE's temporal "
                          "compression)", param=param)
    if frames > s.max_frames:
        raise bad_request(f"{frames} frames asked for ({param}); the limit is {s.max_frames} (max_frames)", param=param)
    return frames, param


def video_params(req: P.VideoCreateRequest, s: VideoSettings) -> tuple[ImageParams, int]:
    """The request's video parameters over the deployment's defaults, within its bounds; and its fps."""
    check_prompt(req.prompt, s)
    if req.size is not None and (req.width is not None or req.height is not None):
        raise bad_request("give size or width and height, not both", param="size")
    if (req.width is None) != (req.height is None):
        raise bad_request("width and height come together", param="width" if req.width is None else "height")
    if req.width is not None:
        width, height, param = req.width, req.height, "width"
    else:
        width, height = parse_size(s.default_size if req.size is None else req.size)
        param = "size"
    check_size(width, height, s, param)
    if max(width, height) > s.max_side:
        raise bad_request(f"size {width}x{height}: a side is at most {s.max_side} pixels (max_side: the model's "
                          "position table)", param=param)
    fps = req.fps if req.fps is not None else s.default_fps
    if fps > s.max_fps:
        raise bad_request(f"fps is {fps}; the limit is {s.max_fps}", param="fps")
    frames, _ = frames_of(req, fps, s)
    return ImageParams(width=width, height=height, num_frames=frames, **denoising(req, s)), fps


def video_object(job: dict) -> dict:
    """A job record as OpenAI's video object, with the diffusion parameters it ran with."""
    v = job.get("video") or {}
    done = job["status"] == "completed"
    return {"id": job["id"], "object": "video", "model": v.get("model"), "status": job["status"],
            "progress": 100 if done else 0, "created_at": job["created_at"], "completed_at": job["completed_at"],
            "expires_at": None, "prompt": v.get("prompt"), "size": v.get("size"), "seconds": v.get("seconds"),
            "remixed_from_video_id": None, "error": job["error"],
            **{k: v.get(k) for k in ("num_frames", "fps", "num_inference_steps", "guidance_scale",
                                     "negative_prompt", "seed")}}


class VideoRoutes:
    def __init__(self, fe: FrontendState, settings: VideoSettings | None, jobs: Jobs):
        self.fe, self.settings, self.jobs = fe, settings, jobs

    def served(self) -> VideoSettings:
        if self.settings is None:
            raise APIError(404, "this pipeline makes no videos (no stage with final_output_type video)",
                           type="not_found_error")
        return self.settings

    @staticmethod
    def video_id(request: Request) -> str:
        vid = request.path_params["video_id"]
        if not vid.startswith(PREFIX):    # a job of another endpoint is not a video
            raise APIError(404, f"video `{vid}` does not exist", type="not_found_error", param="video_id",
                           code="video_not_found")
        return vid

    async def body(self, request: Request) -> bytes:
        """JSON as is; a form (OpenAI's SDK and vllm-omni's examples send one) as the same JSON object. A form
        Starlette cannot read (no boundary, a part over 1 MB, over 1000 fields) is a 400 with its reason; a
        field sent twice is refused (no field of a video takes a list: the last value won silently)."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in FORMS:
            return await request.body()
        fields: dict[str, str] = {}
        try:
            async with request.form() as form:
                for key, value in form.multi_items():
                    if isinstance(value, UploadFile):
                        raise bad_request(f"`{key}` is a file; omni makes videos from text only", param=key)
                    if key in fields:
                        raise bad_request(f"`{key}` is sent twice; a video request takes one value of each field",
                                          param=key)
                    fields[key] = value
        except HTTPException as e:         # Starlette's 400 for a form it cannot parse, in an app
            raise bad_request(f"the form cannot be read: {e.detail}") from None
        except MultiPartException as e:    # the same outside one
            raise bad_request(f"the form cannot be read: {e.message}") from None
        return msgspec.json.encode(fields)

    async def create(self, request: Request) -> Response:
        s = self.served()
        req = P.decode_body(await self.body(request), P.VideoCreateRequest)
        self.fe.check_model(req.model)
        params, fps = video_params(req, s)
        preq = PipelineRequest(request_id=f"vid-{uuid.uuid4().hex}", text=req.prompt, modalities=("video",),
                               image=params)
        meta = {"model": self.fe.model, "prompt": req.prompt, "size": f"{params.width}x{params.height}",
                "seconds": f"{params.num_frames / fps:g}", "num_frames": params.num_frames, "fps": fps,
                "num_inference_steps": params.num_inference_steps, "guidance_scale": params.guidance_scale,
                "negative_prompt": params.negative_prompt, "seed": params.seed}

        async def work() -> tuple[int, str, bytes]:
            frames = await self.render(preq)
            return 200, mp4.CONTENT_TYPE, await anyio.to_thread.run_sync(mp4.encode, frames, fps)

        return JSONResponse(video_object(await self.jobs.submit(ROUTE, work, prefix=PREFIX, extra={"video": meta})))

    async def render(self, preq: PipelineRequest) -> np.ndarray:
        """The video stage's frames, uint8 [frames, height, width, 3]."""
        frames = None
        async for out in media_outputs(self.fe.orch, preq, "video"):
            frames = np.frombuffer(out.image, dtype=np.uint8).reshape(out.image_shape)[0]
        if frames is None:
            raise APIError(500, "the pipeline made no video", type="stage_error")
        return frames

    async def list(self, request: Request) -> Response:
        self.served()
        return JSONResponse(await self.jobs.page(request, "video", (PREFIX,), ROUTE, video_object))

    async def retrieve(self, request: Request) -> Response:
        self.served()
        return JSONResponse(video_object(await self.jobs.record(self.video_id(request), "video")))

    async def content(self, request: Request) -> Response:
        self.served()
        variant = request.query_params.get("variant", "video")
        if variant != "video":
            raise bad_request(f"variant `{variant}` is not kept: omni stores the video only", param="variant")
        return await self.jobs.download(self.video_id(request), "video", mp4.CONTENT_TYPE)

    async def delete(self, request: Request) -> Response:
        self.served()
        vid = self.video_id(request)
        await self.jobs.remove(vid, "video")
        return JSONResponse({"id": vid, "object": "video.deleted", "deleted": True})
