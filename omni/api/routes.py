"""The one route table of the HTTP frontend. Starlette's routes, the metric label of a path,
the control-route guard and the OpenAPI description are all derived from it."""

from __future__ import annotations

import re
from dataclasses import dataclass

import omni
from omni.api import openapi as o
from omni.api import protocol as P
from omni.api.jobs import JobRequest
from omni.api.listing import QUERY as LIST_QUERY
from omni.api.unsupported import NOT_SERVED
from omni.audio_encode import FORMATS

ENCODED_AUDIO = tuple(f.content_type for f in FORMATS.values())    # speech's mp3, flac, opus, aac


@dataclass(frozen=True)
class RouteSpec:
    path: str
    method: str
    family: str                 # text | speech | images | videos | voices | control | jobs | admin (see app.build_app)
    handler: str                # the method of that family's object
    body: type | None = None    # the msgspec type the JSON body decodes into (POST): the OpenAPI schema
    ok: tuple[str, ...] = ("application/json",)   # content types of a success
    control: bool = False       # changes engine state for everyone: --control-api-key / --disable-control-routes
    errors: tuple[int, ...] = ()   # statuses besides the ones every route of its kind answers (openapi.py)
    ok_status: int = 200
    body_required: bool = True
    query: tuple[tuple[str, dict], ...] = ()      # (name, JSON schema) of optional query parameters
    forms: bool = False         # the body may also come as a form (api/browser.py checks the Content-Type)


_STAGE_IDS = ("stage_ids", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": P.MAX_STAGE_ID},
                            "maxItems": P.MAX_STAGE_IDS})   # repeated: ?stage_ids=0&stage_ids=1 (openapi.narrow caps the ids)
GENERATION = (404, 500, 503, 504)     # unknown model or voice; a stage failed; no replica or asleep; timeout
JOB = (404, 503)                       # no such job; the master is unreachable
NEW_JOB = (404, 429, 503)              # unknown model; too many unfinished jobs here; the master is unreachable
ROUTES: tuple[RouteSpec, ...] = (
    RouteSpec("/v1/chat/completions", "POST", "text", "chat", P.ChatCompletionRequest,
              ok=("application/json", "text/event-stream"), errors=GENERATION),
    RouteSpec("/v1/completions", "POST", "text", "completions", P.CompletionRequest,
              ok=("application/json", "text/event-stream"), errors=GENERATION),
    RouteSpec("/tokenize", "POST", "text", "tokenize", P.TokenizeRequest, errors=(404,)),
    RouteSpec("/detokenize", "POST", "text", "detokenize", P.DetokenizeRequest, errors=(404,)),
    RouteSpec("/v1/audio/speech", "POST", "speech", "speech", P.SpeechRequest,
              ok=("audio/wav", "audio/pcm", *ENCODED_AUDIO, "text/event-stream"), errors=GENERATION),
    RouteSpec("/v1/images/generations", "POST", "images", "generations", P.ImageGenerationRequest,
              errors=GENERATION),
    # The Videos API: async, on the jobs' records (every frontend sees every video).
    RouteSpec("/v1/videos", "POST", "videos", "create", P.VideoCreateRequest, errors=NEW_JOB, forms=True),
    RouteSpec("/v1/videos", "GET", "videos", "list", errors=(400, 404, 503), query=LIST_QUERY),
    RouteSpec("/v1/videos/{video_id}", "GET", "videos", "retrieve", errors=JOB),
    RouteSpec("/v1/videos/{video_id}", "DELETE", "videos", "delete", errors=JOB),
    RouteSpec("/v1/videos/{video_id}/content", "GET", "videos", "content", ok=("video/mp4",), errors=(*JOB, 400, 409),
              query=(("variant", {"type": "string", "enum": ["video"], "default": "video"}),)),
    RouteSpec("/v1/audio/voices", "GET", "voices", "list", errors=(404, 503)),
    # forms=True: vllm-omni's upload form reaches the route, which refuses it naming audio_sample
    RouteSpec("/v1/audio/voices", "POST", "voices", "add", P.VoiceSpec, ok_status=201, errors=(404, 409, 503),
              forms=True),
    RouteSpec("/v1/audio/voices/{name}", "DELETE", "voices", "delete", errors=(400, 404, 409, 503)),
    RouteSpec("/v1/omni/sleep", "POST", "control", "sleep", P.SleepRequest, control=True, body_required=False,
              errors=(409, 503)),   # 409: every replica refused (results say why)
    RouteSpec("/v1/omni/wakeup", "POST", "control", "wake_up", P.WakeupRequest, control=True, body_required=False,
              errors=(400, 409, 503)),   # tags, any field
    RouteSpec("/v1/omni/is_sleeping", "GET", "control", "is_sleeping", errors=(503,)),
    # vLLM's paths of the same three (its dev mode's, outside /v1), which tools that drive vLLM's sleep call.
    # Described with vLLM's query parameters; both forms take the JSON body and the query string alike.
    RouteSpec("/sleep", "POST", "control", "sleep", control=True, errors=(400, 409, 503), query=(
        ("level", {"type": "integer", "enum": [1, 2], "default": 1}),
        ("mode", {"type": "string", "enum": ["abort", "wait"], "default": "abort"}), _STAGE_IDS)),
    RouteSpec("/wake_up", "POST", "control", "wake_up", control=True, errors=(400, 409, 503), query=(_STAGE_IDS,)),
    RouteSpec("/is_sleeping", "GET", "control", "is_sleeping", errors=(503,)),
    RouteSpec("/v1/omni/jobs", "POST", "jobs", "create", JobRequest, errors=NEW_JOB),
    RouteSpec("/v1/omni/jobs", "GET", "jobs", "list", errors=(400, 404, 503), query=LIST_QUERY),
    RouteSpec("/v1/omni/jobs/{job_id}", "GET", "jobs", "retrieve", errors=JOB),
    RouteSpec("/v1/omni/jobs/{job_id}", "DELETE", "jobs", "delete", errors=JOB),
    # The result's type is the job's endpoint's: JSON (chat, completions, images) or speech's audio file.
    RouteSpec("/v1/omni/jobs/{job_id}/content", "GET", "jobs", "content", ok=("application/json", "audio/wav", *ENCODED_AUDIO),
              errors=(*JOB, 409)),
    RouteSpec("/v1/models", "GET", "admin", "models"),
    # OpenAI's models.retrieve; a Hugging Face name has a slash (Qwen/Qwen3-Omni-...), hence :path
    RouteSpec("/v1/models/{model:path}", "GET", "admin", "model", errors=(404,)),
    RouteSpec("/health", "GET", "admin", "health", errors=(503,)),
    RouteSpec("/ping", "GET", "admin", "health", errors=(503,)),     # vLLM's (SageMaker's) name for /health
    RouteSpec("/ping", "POST", "admin", "health", errors=(503,), body_required=False),
    RouteSpec("/version", "GET", "admin", "version"),
    RouteSpec("/metrics", "GET", "admin", "metrics", ok=("text/plain",)),
    RouteSpec("/openapi.json", "GET", "admin", "openapi"),
)

CONTROL_PATHS = frozenset(r.path for r in ROUTES if r.control)
JSON_BODIES = {(r.path, r.method): r.forms for r in ROUTES if r.body is not None}   # -> forms too
# vLLM's /sleep and /wake_up are described by their query strings, and read a JSON body all the same
JSON_BODIES |= {("/sleep", "POST"): False, ("/wake_up", "POST"): False}
_EXACT = frozenset(r.path for r in ROUTES if "{" not in r.path)
_TEMPLATES = [(re.compile("^" + re.sub(r"\{\w+\}", "[^/]+", re.sub(r"\{\w+:path\}", ".+", p)) + "$"), o.oas_path(p))
              for p in dict.fromkeys(r.path for r in ROUTES if "{" in r.path)]


def label(path: str) -> str:
    """The route a request path belongs to, as metrics name it (a template, never the raw id)."""
    if path in _EXACT:
        return path
    if path in NOT_SERVED:     # refused (/v1/videos/sync): not a video's template
        return "other"
    for pattern, template in _TEMPLATES:
        if pattern.match(path):
            return template
    return "other"


def openapi_spec(model: str, facts: o.Facts | None = None) -> dict:
    return o.spec(ROUTES, f"omni frontend ({model})", omni.version(), facts)
