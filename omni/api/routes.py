"""The one route table of the HTTP frontend. Starlette's routes, the metric label of a path,
the control-route guard and the OpenAPI description are all derived from it."""

from __future__ import annotations

import re
from dataclasses import dataclass

import omni
from omni.api import openapi as o
from omni.api import protocol as P
from omni.api.jobs import JobRequest


@dataclass(frozen=True)
class RouteSpec:
    path: str
    method: str
    family: str                 # text | speech | voices | control | jobs | admin (see app.build_app)
    handler: str                # the method of that family's object
    body: type | None = None    # the msgspec type the JSON body decodes into (POST): the OpenAPI schema
    ok: str = "application/json"   # content type of a 200
    control: bool = False       # changes engine state for everyone: --control-api-key / --disable-control-routes


ROUTES: tuple[RouteSpec, ...] = (
    RouteSpec("/v1/chat/completions", "POST", "text", "chat", P.ChatCompletionRequest),
    RouteSpec("/v1/completions", "POST", "text", "completions", P.CompletionRequest),
    RouteSpec("/tokenize", "POST", "text", "tokenize", P.TokenizeRequest),
    RouteSpec("/detokenize", "POST", "text", "detokenize", P.DetokenizeRequest),
    RouteSpec("/v1/audio/speech", "POST", "speech", "speech", P.SpeechRequest, ok="audio/wav"),
    RouteSpec("/v1/audio/voices", "GET", "voices", "list"),
    RouteSpec("/v1/audio/voices", "POST", "voices", "add", P.VoiceSpec),
    RouteSpec("/v1/audio/voices/{name}", "DELETE", "voices", "delete"),
    RouteSpec("/v1/omni/sleep", "POST", "control", "sleep", P.SleepRequest, control=True),
    RouteSpec("/v1/omni/wakeup", "POST", "control", "wake_up", control=True),
    RouteSpec("/v1/omni/is_sleeping", "GET", "control", "is_sleeping"),
    RouteSpec("/v1/omni/jobs", "POST", "jobs", "create", JobRequest),
    RouteSpec("/v1/omni/jobs", "GET", "jobs", "list"),
    RouteSpec("/v1/omni/jobs/{job_id}", "GET", "jobs", "retrieve"),
    RouteSpec("/v1/omni/jobs/{job_id}", "DELETE", "jobs", "delete"),
    RouteSpec("/v1/omni/jobs/{job_id}/content", "GET", "jobs", "content"),
    RouteSpec("/v1/models", "GET", "admin", "models"),
    RouteSpec("/health", "GET", "admin", "health"),
    RouteSpec("/ping", "GET", "admin", "health"),     # vLLM's (SageMaker's) name for /health
    RouteSpec("/ping", "POST", "admin", "health"),
    RouteSpec("/version", "GET", "admin", "version"),
    RouteSpec("/metrics", "GET", "admin", "metrics"),
    RouteSpec("/openapi.json", "GET", "admin", "openapi"),
)

CONTROL_PATHS = frozenset(r.path for r in ROUTES if r.control)
_EXACT = frozenset(r.path for r in ROUTES if "{" not in r.path)
_TEMPLATES = [(re.compile("^" + re.sub(r"\{\w+\}", "[^/]+", p) + "$"), p)
              for p in dict.fromkeys(r.path for r in ROUTES if "{" in r.path)]


def label(path: str) -> str:
    """The route a request path belongs to, as metrics name it (a template, never the raw id)."""
    if path in _EXACT:
        return path
    for pattern, template in _TEMPLATES:
        if pattern.match(path):
            return template
    return "other"


def openapi_spec(model: str) -> dict:
    return o.spec(ROUTES, f"omni frontend ({model})", omni.version())
