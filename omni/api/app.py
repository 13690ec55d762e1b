"""The OpenAI-compatible HTTP frontend: a Starlette app over an OrchestratorLike.

Streaming audio in chat (our choice, documented in docs): text deltas go to
`delta.content`; each audio delta is its own chunk with
`delta.audio = {"id", "data": base64 PCM16 LE mono, "format": "pcm16", "sample_rate"}`,
and the finishing chunk carries `delta.audio = {"id", "transcript", "expires_at"}`.
Non-streaming chat puts the whole WAV in `message.audio.data` (base64).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import functools
import hmac
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from omni.api import protocol as P
from omni.api import sse
from omni.api.detok import decoder_for
from omni.api.errors import APIError, api_error_response, bad_request, error_body, error_response, to_api_error
from omni.api.generation import Generation
from omni.api.jobs import Jobs
from omni.api.metrics import FrontendMetrics
from omni.api.voices import InMemoryVoiceStore
from omni.api.wav import pcm16, wav_bytes
from omni.engines.base import SamplingParams
from omni.errors import NotFound
from omni.orchestrator.types import OrchestratorLike, PipelineRequest

log = logging.getLogger(__name__)

# Prompts longer than this (characters) are templated/tokenized on a worker thread so
# the event loop keeps serving other streams. Measured with the SmolLM2 tokenizer: template +
# encode ~0.3 ms at 100 chars, ~3 ms at 2 k, ~56 ms at 20 k; a thread hop costs ~0.13 ms.
OFFLOAD_CHARS = 1024
AUDIO_TTL_S = 3600
_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
           "/v1/omni/sleep", "/v1/omni/wakeup", "/v1/omni/is_sleeping", "/v1/audio/speech",
           "/v1/audio/voices", "/openapi.json", "/v1/omni/jobs", "/tokenize", "/detokenize")


def route_label(path: str) -> str:
    if path in _ROUTES:
        return path
    if path.startswith("/v1/audio/voices/"):
        return "/v1/audio/voices/{name}"
    if path.startswith("/v1/omni/jobs/"):
        return "/v1/omni/jobs/{id}/content" if path.endswith("/content") else "/v1/omni/jobs/{id}"
    return "other"


# Routes that change engine state for every user; `--control-api-key` guards them with a key
# of their own and `--disable-control-routes` turns them off.
CONTROL_ROUTES = ("/v1/omni/sleep", "/v1/omni/wakeup")


class FrontendMiddleware:
    """X-Omni-Frontend on every response, bearer auth on /v1 (and on control routes), request metrics."""

    def __init__(self, app, *, frontend_index: int, api_key: str | None, metrics: FrontendMetrics,
                 control_api_key: str | None = None, control_routes: bool = True):
        self.app = app
        self.header = (b"x-omni-frontend", str(frontend_index).encode())
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.control_key = f"Bearer {control_api_key}".encode() if control_api_key else None
        self.control_routes = control_routes
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        scope["omni.t0"] = t0
        route = route_label(scope["path"])
        status = 500
        self.metrics.started()

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, send_wrapper)
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.finished(route, status, time.monotonic() - t0)

    def _refusal(self, scope) -> Response | None:
        path = scope["path"]
        if path in CONTROL_ROUTES:
            if not self.control_routes:
                return error_response(403, f"{path} is disabled on this server (--disable-control-routes)",
                                      "permission_error", code="control_routes_disabled")
            if self.control_key is not None:
                if self._authorized(scope, self.control_key):
                    return None
                return error_response(401, f"{path} needs the control API key (send Authorization: Bearer "
                                           "<control key>; see --control-api-key)", "invalid_request_error",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        guarded = path.startswith("/v1") or path in ("/tokenize", "/detokenize")
        if self.key is not None and guarded and not self._authorized(scope, self.key):
            return error_response(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                  "invalid_request_error", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        return None

    @staticmethod
    def _authorized(scope, key: bytes) -> bool:
        for k, v in scope["headers"]:
            if k == b"authorization":
                return hmac.compare_digest(v, key)
        return False


class _ClosingStream(StreamingResponse):
    """Starlette cancels a stream on disconnect without closing its iterator; close it here."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def _endpoint(fn: Callable[..., Awaitable[Response]]):
    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except Exception as e:  # every failure becomes an OpenAI error body, never a traceback
            return api_error_response(e)
    return wrapper


async def _until_disconnect(request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
    """Run `work`, cancelling it if the client disconnects first (non-streaming routes)."""
    result: list[Response] = []
    error: list[Exception] = []
    async with anyio.create_task_group() as tg:
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            log.debug("client disconnected from %s; cancelling", request.url.path)
            tg.cancel_scope.cancel()
        tg.start_soon(watch)
        try:
            result.append(await work())
        except Exception as e:  # re-raised outside the group, so it is not wrapped in an ExceptionGroup
            error.append(e)
        tg.cancel_scope.cancel()
    if error:
        raise error[0]
    return result[0] if result else Response(status_code=499)


class Frontend:
    def __init__(self, orchestrator: OrchestratorLike, tokenizer: Any, *, served_model_name: str,
                 model_aliases, frontend_index: int, max_model_len: int, default_max_tokens: int,
                 max_tokens_limit: int | None, speech_entry_stage: int | None, voices,
                 default_temperature: float):
        self.orch = orchestrator
        self.tokenizer = tokenizer
        self.model = served_model_name
        self.names = {served_model_name, *model_aliases}
        self.frontend_index = frontend_index
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.speech_stage = speech_entry_stage
        self.voices = voices if voices is not None or speech_entry_stage is None else InMemoryVoiceStore()
        self.default_temperature = default_temperature
        self.metrics = FrontendMetrics(frontend_index)
        # tokenizer None: a pipeline without a text model (speech only); text routes answer 404.
        self.decode = decoder_for(tokenizer) if tokenizer is not None else (lambda ids: "")
        self.vocab_size = len(tokenizer) if tokenizer is not None else 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._encode = lambda text, special: backend.encode(text, add_special_tokens=special).ids
        else:
            self._encode = lambda text, special: tokenizer.encode(text, add_special_tokens=special)
        # One thread: HF tokenizers are not safe to use from several threads at once.
        self._tok_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omni-tokenize")
        self.created = int(time.time())

    # ---- helpers

    async def _offload(self, heavy: bool, fn, *args):
        if not heavy:
            return fn(*args)
        return await asyncio.wrap_future(self._tok_pool.submit(fn, *args))

    def _render_chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise bad_request(f"the chat template could not render these messages: {e}",
                              param="messages") from None
        return list(self._encode(text, False))

    def _check_token_ids(self, ids: list[int], what: str, param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{what} {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)

    def _need_text(self) -> None:
        if self.tokenizer is None:
            raise APIError(404, "this pipeline has no text model (no tokenizer); only /v1/audio/speech",
                           type="not_found_error")

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    def _max_tokens(self, requested: int | None, n_prompt: int, param: str, what: str) -> int:
        room = self.max_model_len - n_prompt
        if requested is None:
            if room < 1:
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; "
                                  f"the {what} take {n_prompt} tokens, leaving no room for a completion.",
                                  param=what)
            limit = self.max_tokens_limit or room
            return max(1, min(self.default_max_tokens, room, limit))
        if requested < 1:
            raise bad_request(f"{param}={requested} must be at least 1", param=param)
        if self.max_tokens_limit is not None and requested > self.max_tokens_limit:
            raise bad_request(f"{param}={requested} is above this server's limit of "
                              f"{self.max_tokens_limit}", param=param)
        if n_prompt + requested > self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"you requested {n_prompt + requested} tokens ({n_prompt} in the {what}, "
                              f"{requested} in the completion). Reduce the {what} or {param}.", param=param)
        return requested

    def _sampling(self, req, max_tokens: int) -> SamplingParams:
        top_k = req.top_k or 0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if top_k < 0 else top_k,
            seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos)

    async def _voice(self, name: str | None, speed: float = 1.0) -> dict:
        """Resolve a voice (maybe a preset) to what the speech stage needs: a base voice and speed."""
        name = name or "joe"
        if self.voices is None:
            raise bad_request(f"voice `{name}` does not exist; this pipeline has no voices", param="voice")
        get = getattr(self.voices, "get", None)
        v = None
        if get is not None:  # the master-backed store looks one name up without listing all
            try:
                v = await get(name)
            except NotFound:
                v = None
        else:
            v = next((x for x in await self.voices.list() if x["name"] == name), None)
        if v is None:
            known = [x["name"] for x in await self.voices.list()]
            raise bad_request(f"voice `{name}` does not exist; available: {', '.join(known) or 'none'}",
                              param="voice")
        return {"voice": v["base"], "speed": speed * float(v.get("speed", 1.0)), "voice_name": name}

    def _t0(self, request: Request) -> float:
        return request.scope.get("omni.t0", time.monotonic())

    # ---- text routes

    async def chat(self, request: Request) -> Response:
        self._need_text()
        req = P.decode_body(await request.body(), P.ChatCompletionRequest)
        self._check_model(req.model)
        P.check_sampling(req)
        messages = P.chat_messages(req)
        modalities = tuple(req.modalities or ("text",))
        for m in modalities:
            if m not in ("text", "audio"):
                raise bad_request(f"modality `{m}` is not supported (text, audio)", param="modalities")
            if m == "audio" and self.speech_stage is None:
                raise bad_request("modality `audio` is not available: this pipeline has no speech stage",
                                  param="modalities")
        extra: dict = {}
        if "audio" in modalities:
            fmt = req.audio.format if req.audio else "wav"
            if fmt not in ("wav", "pcm16"):
                raise bad_request(f"audio.format `{fmt}` is not supported (wav, pcm16)", param="audio.format")
            extra = await self._voice(req.audio.voice if req.audio else None)
        heavy = sum(len(m["content"]) for m in messages) > OFFLOAD_CHARS
        prompt_ids = await self._offload(heavy, self._render_chat, messages)
        if req.max_completion_tokens is not None:
            mt = self._max_tokens(req.max_completion_tokens, len(prompt_ids), "max_completion_tokens", "messages")
        else:
            mt = self._max_tokens(req.max_tokens, len(prompt_ids), "max_tokens", "messages")
        preq = PipelineRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}", prompt_token_ids=prompt_ids,
                               sampling=self._sampling(req, mt), modalities=modalities, extra=extra)
        gen = Generation(self.orch, preq, decode=self.decode, prompt_ids=prompt_ids,
                         stops=P.stop_list(req.stop), metrics=self.metrics, route="/v1/chat/completions",
                         t0=self._t0(request))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return await _until_disconnect(request, lambda: self._open_stream(gen, self._chat_stream, include_usage))
        return await _until_disconnect(request, lambda: self._chat_full(gen))

    async def _open_stream(self, gen: Generation, body, include_usage: bool) -> Response:
        # Wait for the first output before sending headers, so early failures get a real status.
        await gen.start()
        return _ClosingStream(body(gen, include_usage), media_type="text/event-stream", headers=sse.HEADERS)

    def _chunk(self, gen: Generation, obj: str, choice: dict | None, usage: dict | None = None,
               include_usage: bool = False) -> bytes:
        d = {"id": gen.request.request_id, "object": obj, "created": gen.created, "model": self.model,
             "choices": [choice] if choice is not None else []}
        if include_usage:
            d["usage"] = usage
        return sse.event(d)

    async def _chat_stream(self, gen: Generation, include_usage: bool):
        audio_id = f"audio-{gen.request.request_id}"
        obj = "chat.completion.chunk"
        had_audio = False

        def choice(delta, finish=None):
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        try:
            yield self._chunk(gen, obj, choice({"role": "assistant", "content": ""}), None, include_usage)
            async for ev in gen.events():
                if ev[0] == "text":
                    yield self._chunk(gen, obj, choice({"content": ev[1]}), None, include_usage)
                else:
                    had_audio = True
                    data = base64.b64encode(pcm16(ev[1])).decode()
                    yield self._chunk(gen, obj, choice({"audio": {"id": audio_id, "data": data, "format": "pcm16",
                                                                  "sample_rate": ev[2]}}), None, include_usage)
            final = {}
            if had_audio:
                final["audio"] = {"id": audio_id, "transcript": gen.text,
                                  "expires_at": int(time.time()) + AUDIO_TTL_S}
            yield self._chunk(gen, obj, choice(final, gen.finish_reason), None, include_usage)
            if include_usage:
                yield self._chunk(gen, obj, None, gen.usage(), True)
        except Exception as e:  # after the headers went out, an error is an event in the stream
            err = to_api_error(e)
            yield sse.event(error_body(err.message, err.type, err.param, err.code))
        yield sse.DONE

    async def _chat_full(self, gen: Generation) -> Response:
        await gen.start()
        audio = bytearray()
        async for ev in gen.events():
            if ev[0] == "audio":
                audio += ev[1]
        message: dict = {"role": "assistant", "content": gen.text}
        if audio:
            message["audio"] = {"id": f"audio-{gen.request.request_id}",
                                "data": base64.b64encode(wav_bytes(bytes(audio), gen.sample_rate)).decode(),
                                "format": "wav", "expires_at": int(time.time()) + AUDIO_TTL_S,
                                "transcript": gen.text}
        body = {"id": gen.request.request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": gen.finish_reason}],
                "usage": gen.usage()}
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def completions(self, request: Request) -> Response:
        self._need_text()
        req = P.decode_body(await request.body(), P.CompletionRequest)
        self._check_model(req.model)
        P.check_sampling(req)
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise bad_request("prompt must not be empty", param="prompt")
            prompt_ids = list(await self._offload(len(req.prompt) > OFFLOAD_CHARS, self._encode, req.prompt, True))
        else:
            prompt_ids = list(req.prompt)
            if not prompt_ids:
                raise bad_request("prompt must not be empty", param="prompt")
            self._check_token_ids(prompt_ids, "prompt token id", "prompt")
        mt = self._max_tokens(req.max_tokens, len(prompt_ids), "max_tokens", "prompt")
        preq = PipelineRequest(request_id=f"cmpl-{uuid.uuid4().hex}", prompt_token_ids=prompt_ids,
                               sampling=self._sampling(req, mt))
        gen = Generation(self.orch, preq, decode=self.decode, prompt_ids=prompt_ids,
                         stops=P.stop_list(req.stop), metrics=self.metrics, route="/v1/completions",
                         t0=self._t0(request))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return await _until_disconnect(
                request, lambda: self._open_stream(gen, self._completion_stream, include_usage))
        return await _until_disconnect(request, lambda: self._completion_full(gen))

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize; frontend work only (no stage is involved)."""
        self._need_text()
        req = P.decode_body(await request.body(), P.TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of `prompt` and `messages`", param="prompt")
        if req.messages is not None:
            messages = P.chat_messages(req)
            ids = await self._offload(sum(len(m["content"]) for m in messages) > OFFLOAD_CHARS,
                                      self._render_chat, messages)
        else:
            ids = list(await self._offload(len(req.prompt) > OFFLOAD_CHARS, self._encode, req.prompt,
                                           req.add_special_tokens))
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        self._need_text()
        req = P.decode_body(await request.body(), P.DetokenizeRequest)
        self._check_model(req.model)
        self._check_token_ids(req.tokens, "token id", "tokens")
        text = await self._offload(len(req.tokens) > OFFLOAD_CHARS // 4, self.tokenizer.decode, req.tokens)
        return JSONResponse({"prompt": text})

    async def _completion_stream(self, gen: Generation, include_usage: bool):
        def choice(text, finish=None):
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        try:
            async for ev in gen.events():
                if ev[0] == "text":
                    yield self._chunk(gen, "text_completion", choice(ev[1]), None, include_usage)
            yield self._chunk(gen, "text_completion", choice("", gen.finish_reason), None, include_usage)
            if include_usage:
                yield self._chunk(gen, "text_completion", None, gen.usage(), True)
        except Exception as e:
            err = to_api_error(e)
            yield sse.event(error_body(err.message, err.type, err.param, err.code))
        yield sse.DONE

    async def _completion_full(self, gen: Generation) -> Response:
        await gen.start()
        async for _ in gen.events():
            pass
        body = {"id": gen.request.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}],
                "usage": gen.usage()}
        return Response(msgspec.json.encode(body), media_type="application/json")

    # ---- speech and voices

    def _need_speech(self) -> None:
        if self.speech_stage is None:
            raise APIError(404, "this pipeline has no speech output (no talker stage)", type="not_found_error")

    async def speech(self, request: Request) -> Response:
        self._need_speech()
        req = P.decode_body(await request.body(), P.SpeechRequest)
        self._check_model(req.model)
        if not req.input.strip():
            raise bad_request("input must not be empty", param="input")
        if len(req.input) > 4096:
            raise bad_request(f"input is {len(req.input)} characters; the limit is 4096", param="input")
        if req.response_format not in ("wav", "pcm"):
            raise bad_request(f"response_format `{req.response_format}` is not supported (wav, pcm)",
                              param="response_format")
        P.check_speed(req.speed)
        extra = await self._voice(req.voice, req.speed)
        preq = PipelineRequest(request_id=f"speech-{uuid.uuid4().hex}", text=req.input,
                               entry_stage=self.speech_stage, modalities=("audio",), extra=extra)
        gen = Generation(self.orch, preq, decode=self.decode, prompt_ids=[], stops=[], metrics=self.metrics,
                         route="/v1/audio/speech", t0=self._t0(request))

        async def stream_pcm() -> Response:
            # Raw s16le as it is made (OpenAI's stream_format "audio"): the first bytes leave
            # with the first chunk, not with the last. A WAV answer needs its length up front.
            await gen.start()
            if not gen.first_sample_rate:
                await gen.close()
                raise APIError(500, "the pipeline finished without producing audio", type="stage_error")

            async def body():
                async for ev in gen.events():
                    if ev[0] == "audio":
                        yield pcm16(ev[1])
            return _ClosingStream(body(), media_type="audio/pcm",
                                  headers={"X-Sample-Rate": str(gen.first_sample_rate or 22050)})

        if req.response_format == "pcm":
            return await _until_disconnect(request, stream_pcm)

        async def work() -> Response:
            await gen.start()
            audio = bytearray()
            async for ev in gen.events():
                if ev[0] == "audio":
                    audio += ev[1]
            if not audio:
                raise APIError(500, "the pipeline finished without producing audio", type="stage_error")
            headers = {"X-Sample-Rate": str(gen.sample_rate)}
            return Response(wav_bytes(bytes(audio), gen.sample_rate), media_type="audio/wav", headers=headers)

        return await _until_disconnect(request, work)

    async def list_voices(self, request: Request) -> Response:
        self._need_speech()
        voices = await self.voices.list()
        return JSONResponse({"object": "list", "data": voices})

    async def add_voice(self, request: Request) -> Response:
        self._need_speech()
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/"):
            raise APIError(415, "send the voice as JSON {\"name\", \"base\", \"speed\"}; multipart is not supported")
        spec = P.decode_body(await request.body(), P.VoiceSpec)
        builtin = [v["name"] for v in await self.voices.list() if v.get("builtin")]
        P.check_voice_spec(spec, builtin)
        entry = await self.voices.add(spec.name, {"base": spec.base, "speed": spec.speed})
        return JSONResponse(entry, status_code=201)

    async def delete_voice(self, request: Request) -> Response:
        self._need_speech()
        name = request.path_params["name"]
        await self.voices.delete(name)
        return JSONResponse({"name": name, "deleted": True})

    # ---- models, health, metrics, sleep

    async def models(self, request: Request) -> Response:
        data = [{"id": n, "object": "model", "created": self.created, "owned_by": "omni", "root": self.model,
                 "parent": None, "max_model_len": self.max_model_len}
                for n in [self.model, *sorted(self.names - {self.model})]]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        try:
            ok, reason = self.orch.health()
        except Exception as e:
            ok, reason = False, f"health check failed: {type(e).__name__}: {e}"
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    async def metrics_route(self, request: Request) -> Response:
        text = self.metrics.render()
        try:
            text += self.orch.metrics_text()
        except Exception as e:
            log.warning("orchestrator metrics failed: %s: %s", type(e).__name__, e)
            text += f"# orchestrator metrics unavailable: {type(e).__name__}\n"
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def sleep(self, request: Request) -> Response:
        body = await request.body()
        req = P.decode_body(body, P.SleepRequest) if body.strip() else P.SleepRequest()
        if req.level not in (1, 2):
            raise bad_request(f"level={req.level} must be 1 or 2", param="level")
        return JSONResponse(await self.orch.sleep(req.level))

    async def wake_up(self, request: Request) -> Response:
        return JSONResponse(await self.orch.wake_up())

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": bool(await self.orch.is_sleeping())})

    async def openapi(self, request: Request) -> Response:
        from omni.api.openapi import spec
        return JSONResponse(spec(self.model))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_)


def build_app(orchestrator: OrchestratorLike, tokenizer: Any, *, served_model_name: str,
              model_aliases=(), frontend_index: int = 0, max_model_len: int, default_max_tokens: int = 256,
              max_tokens_limit: int | None = None, speech_entry_stage: int | None = None, voices=None,
              api_key: str | None = None, default_temperature: float = 1.0, jobs: Jobs | None = None,
              control_api_key: str | None = None, control_routes: bool = True) -> Starlette:
    """`jobs`: the async job routes' state (master KV + shared result dir); in memory when None."""
    f = Frontend(orchestrator, tokenizer, served_model_name=served_model_name, model_aliases=model_aliases,
                 frontend_index=frontend_index, max_model_len=max_model_len,
                 default_max_tokens=default_max_tokens, max_tokens_limit=max_tokens_limit,
                 speech_entry_stage=speech_entry_stage, voices=voices, default_temperature=default_temperature)
    e = _endpoint
    jobs = jobs if jobs is not None else Jobs(frontend_index=frontend_index)
    runnable = {}
    if tokenizer is not None:
        runnable.update({"/v1/chat/completions": e(f.chat), "/v1/completions": e(f.completions)})
    if speech_entry_stage is not None:
        runnable["/v1/audio/speech"] = e(f.speech)
    jobs.bind(runnable)
    routes = [
        Route("/v1/chat/completions", e(f.chat), methods=["POST"]),
        Route("/v1/completions", e(f.completions), methods=["POST"]),
        Route("/v1/models", e(f.models), methods=["GET"]),
        Route("/tokenize", e(f.tokenize), methods=["POST"]),
        Route("/detokenize", e(f.detokenize), methods=["POST"]),
        Route("/health", e(f.health), methods=["GET"]),
        Route("/metrics", e(f.metrics_route), methods=["GET"]),
        Route("/v1/omni/sleep", e(f.sleep), methods=["POST"]),
        Route("/v1/omni/wakeup", e(f.wake_up), methods=["POST"]),
        Route("/v1/omni/is_sleeping", e(f.is_sleeping), methods=["GET"]),
        Route("/v1/audio/speech", e(f.speech), methods=["POST"]),
        Route("/v1/audio/voices", e(f.list_voices), methods=["GET"]),
        Route("/v1/audio/voices", e(f.add_voice), methods=["POST"]),
        Route("/v1/audio/voices/{name}", e(f.delete_voice), methods=["DELETE"]),
        Route("/openapi.json", e(f.openapi), methods=["GET"]),
        Route("/v1/omni/jobs", e(jobs.create), methods=["POST"]),
        Route("/v1/omni/jobs", e(jobs.list), methods=["GET"]),
        Route("/v1/omni/jobs/{job_id}", e(jobs.retrieve), methods=["GET"]),
        Route("/v1/omni/jobs/{job_id}", e(jobs.delete), methods=["DELETE"]),
        Route("/v1/omni/jobs/{job_id}/content", e(jobs.content), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(FrontendMiddleware, frontend_index=frontend_index, api_key=api_key,
                                           metrics=f.metrics, control_api_key=control_api_key,
                                           control_routes=control_routes)])
    app.state.frontend = f
    app.state.jobs = jobs
    return app
