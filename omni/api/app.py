"""The OpenAI-compatible HTTP frontend: a Starlette app over an OrchestratorLike.

Route families, one module each: text (chat, completions, tokenize), speech, images, videos, voices,
control (sleep/wake), jobs, admin (models, health, metrics, openapi); the one route
table (omni/api/routes.py) binds paths to them.
"""

from __future__ import annotations

from typing import Any, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from omni.api import cors, unsupported
from omni.api.admin import AdminRoutes
from omni.api.control import ControlRoutes
from omni.api.http import FrontendMiddleware, by_method, endpoint, http_error
from omni.api.images import ROUTE as IMAGES, ImageRoutes
from omni.api.jobs import BODY_TYPES, Jobs
from omni.api.limits import HttpLimits, LimitsMiddleware
from omni.api.routes import ROUTES
from omni.api.speech import SpeechRoutes
from omni.api.state import FrontendState
from omni.api.text import TextRoutes
from omni.api.videos import VideoRoutes
from omni.api.voices import VoiceRoutes
from omni.config import ImageSettings, VideoSettings
from omni.orchestrator.types import OrchestratorLike
from omni.sampling import SamplingOverrides


def build_app(orchestrator: OrchestratorLike, tokenizer: Any, *, served_model_name: str | Sequence[str],
              model_aliases=(), frontend_index: int = 0, max_model_len: int, default_max_tokens: int | None = None,
              max_tokens_limit: int | None = None, speech_entry_stage: int | None = None, voices=None,
              api_key: str | Sequence[str] | None = None, sampling_defaults: SamplingOverrides | None = None,
              jobs: Jobs | None = None,
              control_api_key: str | None = None, control_routes: bool = True, audio_out: bool | None = None,
              speakers: tuple[str, ...] = (), default_voice: str | None = None,
              limits: HttpLimits | None = None, max_speech_chars: int = 4096,
              images: ImageSettings | None = None, videos: VideoSettings | None = None,
              num_stages: int | None = None, default_modalities: tuple[str, ...] = ("text",),
              model_path: str | None = None) -> Starlette:
    """`served_model_name`: one name or several (the first reported); `api_key`: one key or several
    (any one accepted). `jobs`: the async job routes' state (master KV + shared result dir); in memory when None.
    `limits`: request body cap and body timeout (the defaults when None). `images`: the image
    route's defaults and bounds, None when the pipeline makes no images; `videos` the same for the
    Videos API (its videos are jobs of `jobs`)."""
    fe = FrontendState(orchestrator, tokenizer, served_model_name=served_model_name, model_aliases=model_aliases,
                       frontend_index=frontend_index, max_model_len=max_model_len,
                       default_max_tokens=default_max_tokens, max_tokens_limit=max_tokens_limit,
                       speech_entry_stage=speech_entry_stage, voices=voices, sampling_defaults=sampling_defaults,
                       audio_out=audio_out, speakers=speakers, default_voice=default_voice,
                       max_speech_chars=max_speech_chars, model_path=model_path)
    jobs = jobs if jobs is not None else Jobs(frontend_index=frontend_index)
    admin = AdminRoutes(fe)
    families = {"text": TextRoutes(fe), "speech": SpeechRoutes(fe), "images": ImageRoutes(fe, images),
                "videos": VideoRoutes(fe, videos, jobs),
                "voices": VoiceRoutes(fe),
                "control": ControlRoutes(fe), "jobs": jobs, "admin": admin}
    handlers = {(r.path, r.method): endpoint(getattr(families[r.family], r.handler)) for r in ROUTES}
    # Jobs run what this pipeline serves: text routes need a tokenizer, speech a speech stage, images an image stage.
    served = {"text": tokenizer is not None, "speech": speech_entry_stage is not None, "images": images is not None}
    jobs.bind({r.path: handlers[(r.path, r.method)] for r in ROUTES
               if r.path in BODY_TYPES and r.method == "POST" and served.get(r.family, True)},
              checks={IMAGES: families["images"].check, "/v1/chat/completions": families["text"].chat_request,
                      "/v1/completions": families["text"].completion_request,
                      "/v1/audio/speech": families["speech"].speech_request})
    by_path: dict[str, dict] = {}
    for r in ROUTES:
        by_path.setdefault(r.path, {})[r.method] = handlers[(r.path, r.method)]
    fe.job_endpoints = tuple(jobs.handlers)
    fe.images = images
    fe.videos = videos
    fe.num_stages = num_stages
    fe.default_modalities = tuple(default_modalities)
    # refusals first: /v1/videos/sync would match /v1/videos/{video_id}
    routes = unsupported.routes() + [Route(path, by_method(methods)) for path, methods in by_path.items()]
    limits = limits or HttpLimits()
    streams: set = set()   # open streams, which serve() ends cleanly at its stop
    in_flight: set = set()   # requests serve() answers 503 at its stop if they have not begun to
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                    middleware=[*cors.middleware(limits),   # outermost: a browser's preflight carries no key
                                Middleware(FrontendMiddleware, frontend_index=frontend_index, api_key=api_key,
                                           metrics=fe.metrics, control_api_key=control_api_key,
                                           control_routes=control_routes, fast=admin.fast(),
                                           allowed_origins=limits.allowed_origins,
                                           allowed_hosts=limits.allowed_hosts, streams=streams,
                                           in_flight=in_flight),
                               # inside: a refused body still gets X-Omni-Frontend and is counted
                               Middleware(LimitsMiddleware, limits=limits)])
    app.state.frontend = fe
    app.state.jobs = jobs
    app.state.streams = streams
    app.state.in_flight = in_flight
    return app
