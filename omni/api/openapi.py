"""The OpenAPI description, generated from the msgspec types that decode the request bodies
(omni/api/protocol.py) and the error body (omni/api/errors.py), so what it says a route takes is
what the route accepts; the paths, parameters and statuses come from the route table
(omni/api/routes.py). `Facts` are what only the running deployment knows (its model names, the
vocabulary, its limits, its built-in voices): they narrow the generated schemas to the values
this server accepts."""

from __future__ import annotations

import copy
import re
from typing import Any
from dataclasses import dataclass

import msgspec

from omni.api import protocol as P
from omni.api.errors import ErrorResponse

REF = "#/components/schemas/{name}"
ERROR = {"$ref": REF.format(name="ErrorResponse")}
REASONS = {400: "Bad request: the message names the parameter", 401: "Missing or wrong API key",
           403: "Control routes are disabled on this server, or a cross-site request (Origin) with no API key",
           404: "Not found (the message says what)",
           408: "The request body did not arrive in time", 409: "Conflicts with the state of what it names",
           413: "Request body too large",
           429: "Too many unfinished jobs on this frontend (the message names the limit)",
           500: "Internal error (a stage failed)", 503: "No READY replica, asleep, or the master is unreachable",
           504: "The request timed out in the pipeline"}
# --api-key (omni/api/http.py): every path under /v1, and these outside it
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/sleep", "/wake_up", "/is_sleeping"})


@dataclass(frozen=True)
class Facts:
    models: tuple[str, ...] = ()          # the names `model` may take
    vocab_size: int = 0                   # token ids are below it
    max_tokens: int | None = None         # the most max_tokens one request may ask for
    max_speech_chars: int | None = None
    audio_in: bool = False                # chat takes input_audio parts
    audio_out: bool = False               # chat takes modalities ["audio"]
    builtin_voices: tuple[str, ...] = ()
    job_endpoints: tuple[str, ...] = ()
    images: Any = None                    # omni.config.ImageSettings: the image route's bounds
    videos: Any = None                    # omni.config.VideoSettings: the Videos API's bounds
    num_stages: int | None = None         # sampling_params_list's most entries
    stage_max_tokens: int | None = None   # the server's max_tokens limit, on every sampling_params_list entry
    template_kwargs: tuple[str, ...] | None = None   # chat_template_kwargs' keys (None: not known)


def spec(routes, title: str, version: str, facts: Facts | None = None) -> dict:
    types = list(dict.fromkeys(r.body for r in routes if r.body is not None)) + [ErrorResponse]
    refs, components = msgspec.json.schema_components(types, ref_template=REF)
    ref_of = dict(zip(types, refs))
    for name, extra in P.SCHEMA_EXTRA.items():
        if name in components:
            components[name].update(extra)
    if facts is not None:
        narrow(components, facts)
    paths: dict[str, dict] = {}
    for r in routes:
        paths.setdefault(oas_path(r.path), {})[r.method.lower()] = operation(r, ref_of.get(r.body))
    if facts is not None and facts.num_stages:   # the query's stage_ids, as narrow() caps the bodies'
        for op in (o for ops in paths.values() for o in ops.values()):
            for p in op.get("parameters", ()):
                if p["name"] == "stage_ids":
                    p["schema"] = {**p["schema"], "items": {**p["schema"]["items"], "maximum": facts.num_stages - 1}}
    # 3.1: its schemas are JSON Schema 2020-12, what msgspec writes (null unions as anyOf).
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components}}


def oas_path(path: str) -> str:
    """Starlette's `{model:path}` is OpenAPI's `{model}`."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


def statuses(r) -> list[int]:
    codes = {413, 500, *r.errors}
    if r.body is not None:
        codes |= {400, 408}
    if r.path.startswith("/v1") or r.path in KEYED_PATHS or r.control:
        codes.add(401)
    if r.control or r.method not in ("GET", "HEAD"):   # api/browser.py: another site's Origin
        codes.add(403)
    return sorted(codes)


def operation(r, body: dict | None) -> dict:
    responses = {str(r.ok_status): {"description": "OK", "content": {t: {} for t in r.ok}}}
    for code in statuses(r):
        responses[str(code)] = {"description": REASONS[code], "content": {"application/json": {"schema": ERROR}}}
    op: dict = {"responses": responses}
    params = [{"name": name, "in": "path", "required": True, "schema": _path_schema(name)}
              for name in re.findall(r"\{(\w+)\}", oas_path(r.path))]
    params += [{"name": name, "in": "query", "required": False, "schema": schema} for name, schema in r.query]
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"required": r.body_required, "content": {"application/json": {"schema": body}}}
    return op


def _path_schema(name: str) -> dict:
    from omni.api.jobs import JOB_ID_RE

    patterns = {"job_id": JOB_ID_RE.pattern, "name": P.VOICE_NAME, "video_id": r"^video_[0-9a-f]{32}$"}
    if name == "model":   # any name: an unknown one is the documented 404
        return {"type": "string"}
    return {"type": "string", "pattern": patterns[name]}


def below(n: int) -> str:
    """A regex of the decimal numbers 0 .. n-1 (no leading zeros): logit_bias keys are token ids."""
    if n <= 0:
        return "^(?!)$"
    top = str(n - 1)
    alts = ["[0-9]"] if len(top) > 1 else [f"[0-{top}]"]
    alts += [f"[1-9][0-9]{{{k - 1}}}" for k in range(2, len(top))]
    if len(top) > 1:   # numbers of len(top) digits up to top, digit by digit
        for i, d in enumerate(top):
            head, rest = top[:i], len(top) - i - 1
            low = "1" if i == 0 else "0"
            if i == len(top) - 1:
                alts.append(f"{head}[{low}-{d}]")
            elif int(d) > int(low):
                alts.append(f"{head}[{low}-{int(d) - 1}][0-9]{{{rest}}}")
    return "^(" + "|".join(alts) + ")$"


def narrow(components: dict, f: Facts) -> None:
    """Deployment facts into the generated schemas, in place."""
    def prop(type_name: str, field: str) -> dict | None:
        return components.get(type_name, {}).get("properties", {}).get(field)

    def first(schema: dict) -> dict:   # the non-null alternative of an optional field
        return next((s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"), schema)

    requests = ("ChatCompletionRequest", "CompletionRequest", "SpeechRequest", "TokenizeRequest",
                "DetokenizeRequest", "ImageGenerationRequest", "VideoCreateRequest")
    for name in requests:
        s = prop(name, "model")
        if s is not None and f.models:
            first(s).update(enum=sorted(f.models))
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        for field in ("max_tokens", "max_completion_tokens"):
            s = prop(name, field)
            if s is not None and f.max_tokens is not None:
                first(s)["maximum"] = f.max_tokens
        s = prop(name, "logit_bias")
        if s is not None and f.vocab_size:
            first(s)["propertyNames"] = {"pattern": below(f.vocab_size)}
    if f.vocab_size:
        s = prop("DetokenizeRequest", "tokens")
        if s is not None:
            s["items"]["maximum"] = f.vocab_size - 1
        _cap_token_ids(prop("CompletionRequest", "prompt"), f.vocab_size - 1)
        for name in ("ChatCompletionRequest", "CompletionRequest"):   # the frontend checks them (state.py)
            _cap_token_ids(prop(name, "stop_token_ids"), f.vocab_size - 1)
        s = prop("ChatCompletionRequest", "sampling_params_list")
        if s is not None and "StageSampling" in components:   # entry 0 is the prompt stage's: its vocabulary
            entry = copy.deepcopy(components["StageSampling"])
            _cap_token_ids(entry.get("properties", {}).get("stop_token_ids"), f.vocab_size - 1)
            first(s)["prefixItems"] = [entry]
    for name in ("SleepRequest", "WakeupRequest") if f.num_stages else ():
        s = prop(name, "stage_ids")
        if s is not None:
            first(s)["items"]["maximum"] = f.num_stages - 1
    s = prop("SpeechRequest", "input")
    if s is not None and f.max_speech_chars is not None:
        s["maxLength"] = min(s.get("maxLength", f.max_speech_chars), f.max_speech_chars)
    if f.images is not None:
        for field, most in (("n", f.images.max_n), ("num_inference_steps", f.images.max_steps)):
            s = prop("ImageGenerationRequest", field)
            if s is not None:
                first(s)["maximum"] = min(first(s).get("maximum", most), most)
        s = prop("ImageGenerationRequest", "prompt")
        if s is not None:
            s["maxLength"] = min(s.get("maxLength", f.images.max_prompt_chars), f.images.max_prompt_chars)
    if f.videos is not None:
        v = f.videos
        for field, most in (("num_inference_steps", v.max_steps), ("num_frames", v.max_frames), ("fps", v.max_fps)):
            s = prop("VideoCreateRequest", field)
            if s is not None:
                first(s)["maximum"] = min(first(s).get("maximum", most), most)
    s = prop("ChatCompletionRequest", "sampling_params_list")
    if s is not None and f.num_stages is not None:
        first(s)["maxItems"] = min(first(s).get("maxItems", f.num_stages), f.num_stages)
    s = prop("StageSampling", "max_tokens")
    if s is not None and f.stage_max_tokens is not None:
        first(s)["maximum"] = f.stage_max_tokens
    for name in ("ChatCompletionRequest", "TokenizeRequest"):
        s = prop(name, "chat_template_kwargs")
        if s is not None and f.template_kwargs is not None:
            first(s).update({"propertyNames": {"enum": list(f.template_kwargs)}} if f.template_kwargs
                            else {"maxProperties": 0})
    s = prop("VoiceSpec", "base")
    if s is not None and f.builtin_voices:
        s["enum"] = sorted(f.builtin_voices)
    chat = components.get("ChatCompletionRequest")
    if chat is not None:   # top_logprobs > 0 needs logprobs: true (logprobs_k), as in OpenAI's API
        chat["if"] = {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}}
        chat["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
    s = prop("ChatCompletionRequest", "modalities")
    if s is not None and not f.audio_out:
        first(s)["items"] = {"enum": ["text"]}
    s = prop("ChatMessage", "content")
    if s is not None and not f.audio_in:
        for alt in s.get("anyOf", []):
            items = alt.get("items", {})
            if "discriminator" in items:   # text parts only
                alt["items"] = {"$ref": items["discriminator"]["mapping"]["text"]}
    if "JobRequest" in components:
        components["JobRequest"] = _job_request(f, components)


def _cap_token_ids(schema, top: int) -> None:
    """Every token id the prompt's schema allows (flat, or nested in a list), at most `top`."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = top
        for v in schema.values():
            _cap_token_ids(v, top)
    elif isinstance(schema, list):
        for v in schema:
            _cap_token_ids(v, top)


def _job_request(f: Facts, components: dict) -> dict:
    """One alternative per endpoint a job may run here: its body is that endpoint's request, not streamed."""
    from omni.api.jobs import BODY_TYPES

    alts = []
    for endpoint in f.job_endpoints:
        name = BODY_TYPES[endpoint].__name__
        body = copy.deepcopy(components[name])
        if "stream" in body.get("properties", {}):
            body["properties"]["stream"] = {"const": False, "default": False}
        alts.append({"type": "object", "required": ["endpoint", "body"], "additionalProperties": False,
                     "properties": {"endpoint": {"const": endpoint}, "body": body}})
    return {"title": "JobRequest", "oneOf": alts} if alts else components["JobRequest"]
