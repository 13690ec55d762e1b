"""Text routes: /v1/chat/completions, /v1/completions (SSE streaming, stop strings, audio in
chat), and vLLM's /tokenize and /detokenize (frontend work only).

Streaming audio in chat (our choice, documented in docs): text deltas go to
`delta.content`; each audio delta is its own chunk with
`delta.audio = {"id", "data": base64 PCM16 LE mono, "format": "pcm16", "sample_rate"}`,
and the finishing chunk carries `delta.audio = {"id", "transcript", "expires_at"}` beside its `content`.
Every chat chunk but the usage chunk names its `modality` ("text" or "audio"), as vllm-omni's
stream does (its clients read it); a request without an `audio` object (vllm-omni's clients
send none) gets each chunk's audio as a WAV file of that chunk (`"format": "wav"`), also in
`delta.content`, where vllm-omni puts it; OpenAI's clients send `audio` and get raw pcm16 as OpenAI streams it.
The usage of a request with audio adds `audio_duration_s` and `audio_ttfp_s`.

As vLLM's server streams: `finish_reason` rides on the chunk with the last token (an empty
delta when that token has no text, e.g. EOS) with `stop_reason` (the stop string or stop token
id that ended it, else null; completions chunks carry it null before), that chunk carries its tokens' logprobs, and
`stream_options.include_usage` adds one `choices: []` chunk with the usage after it
(`continuous_usage_stats` also puts the usage so far on every chunk).
Non-streaming chat puts the whole WAV (`audio.format` "pcm16": raw s16le; mp3, flac, opus, aac: that file) in
`message.audio.data` (base64); streamed, those four are refused (OpenAI streams pcm16 only):
OpenAI's one choice with a request's `audio` object, else vllm-omni's choice after the text's (_chat_full).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import re
import time
import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.api import logprobs as LP
from omni.api import protocol as P
from omni.api import sse
from omni.api.audio_metrics import AudioStream
from omni.api.errors import bad_request, error_body, to_api_error
from omni.api.generation import Generation
from omni.api.http import STOPPING, ClosingStream, until_disconnect
from omni.api.job_prepared import prepared
from omni.api.state import OFFLOAD_CHARS, FrontendState
from omni.api.wav import pcm16, wav_bytes
from omni.audio_encode import FORMATS, encode
from omni.orchestrator.types import PipelineRequest

AUDIO_TTL_S = 3600


def usage_mode(opts: P.StreamOptions | None) -> str | None:
    """None, "final" (one usage chunk at the end) or "continuous" (on every chunk too), as vLLM reads
    `stream_options` (continuous_usage_stats counts only with include_usage)."""
    if not (opts and opts.include_usage):
        return None
    return "continuous" if opts.continuous_usage_stats else "final"


_ID = re.compile(r"[!-~]{1,256}")     # as protocol's request_id: it is echoed back


def answer_id(request: Request, req: P._Sampling, prefix: str) -> str | None:
    """The answer's id as vLLM 0.32's serving names it (_base_request_id): the X-Request-Id header over
    the body's request_id, after `prefix`; None: a fresh one. The pipeline keeps ids of its own. A header
    that is no such id (spaces, non-ASCII, over 256 characters: vLLM takes any) is passed over, not refused:
    proxies and tracing middleware set it, not the client."""
    rid = request.headers.get("x-request-id")
    if rid is None or not _ID.fullmatch(rid):
        rid = req.request_id
    return rid and f"{prefix}-{rid}"


def content_chars(messages: list[dict]) -> int:
    """Characters of the messages' text (audio parts count nothing; the template adds, never removes)."""
    n = 0
    for m in messages:
        c = m["content"]
        n += len(c) if isinstance(c, str) else sum(len(p.get("text") or "") for p in c)
    return n


class TextRoutes:
    def __init__(self, fe: FrontendState):
        self.fe = fe

    async def chat(self, request: Request) -> Response:
        req, preq = prepared(request) or await self.chat_request(await request.body())   # a job's: at its submit
        audio = None
        if preq.audio_out:
            audio = AudioStream(self.fe.metrics.audio, self.fe.model, preq.voice,
                                self.fe.t0(request), streamed=bool(req.stream))
        gen = Generation(self.fe.orch, preq, decode=self.fe.decode, prompt_ids=preq.prompt_token_ids,
                         stops=P.stop_list(req.stop), include_stop=bool(req.include_stop_str_in_output),
                         metrics=self.fe.metrics, route="/v1/chat/completions",
                         t0=self.fe.t0(request), eos_token_id=self.fe.tokenizer.eos_token_id, audio=audio,
                         response_id=answer_id(request, req, "chatcmpl"))
        if req.stream:
            body = functools.partial(self._chat_stream, wav_chunks=req.audio is None)
            return await until_disconnect(
                request, lambda: self._open_stream(gen, body, usage_mode(req.stream_options)))
        return await until_disconnect(request, lambda: self._chat_full(gen, req.audio.format if req.audio else "wav",
                                                                       openai=req.audio is not None))

    async def chat_request(self, raw: bytes) -> tuple[P.ChatCompletionRequest, PipelineRequest]:
        """The body and its pipeline request, or the 4xx chat answers before running anything (a job's
        submit runs this too, so a job is refused as the route refuses it)."""
        self.fe.need_text()
        req = P.decode_body(raw, P.ChatCompletionRequest)
        self.fe.check_model(req.model)
        logprobs = P.check_sampling(req)
        self.fe.check_message_count(len(req.messages))
        audios: list = []
        messages = P.chat_messages(req, audios)
        modalities = tuple(req.modalities or self.fe.default_modalities)
        for m in modalities:
            if m not in ("text", "audio"):
                raise bad_request(f"modality `{m}` is not supported (text, audio)", param="modalities")
            if m == "audio" and not self.fe.audio_out:
                raise bad_request("modality `audio` is not available: this pipeline has no speech stage",
                                  param="modalities")
        voice = speed = None
        if "audio" in modalities:
            fmt = req.audio.format if req.audio else "wav"
            if fmt not in P.CHAT_AUDIO_FORMATS:
                raise bad_request(f"audio.format `{fmt}` is not supported ({', '.join(P.CHAT_AUDIO_FORMATS)})",
                                  param="audio.format")
            if req.stream and fmt in FORMATS:    # as OpenAI's: a streamed chat's audio is pcm16
                raise bad_request(f"audio.format `{fmt}` cannot be streamed: with stream, a chat's audio comes as "
                                  "pcm16 (wav or pcm16 here), or as WAV chunks without an `audio` object",
                                  param="audio.format")
            asked, field = P.chat_voice(req)
            voice, speed = await self.fe.voice(asked, param=field)
        inputs = {}
        if audios:
            self.fe.need_audio_in()
            inputs = await self.fe.offload(True, self.fe.audio_inputs, audios)   # decode + resample
        chars = content_chars(messages)
        self.fe.check_prompt_chars(chars, "messages", "messages")
        kwargs = self.fe.template_kwargs(req.chat_template_kwargs)
        # by the body too: a million empty messages are seconds of templating with no content
        prompt_ids = await self.fe.offload(max(chars, len(raw)) > OFFLOAD_CHARS, self.fe.render_chat, messages,
                                           kwargs, P.chat_ending(req), req.add_special_tokens)
        self.fe.check_placeholders(prompt_ids, len(audios))
        # The prompt as the stages see it: vLLM expands each audio's one placeholder to its tower's positions.
        n_audio = self.fe.audio_positions(inputs)
        n_prompt = len(prompt_ids) - len(inputs) + n_audio
        if "audio" in modalities:
            self.fe.check_audio_prompt(n_prompt, n_audio)
        if req.max_completion_tokens is not None:
            mt = self.fe.max_tokens(req.max_completion_tokens, n_prompt, "max_completion_tokens", "messages")
        else:
            mt = self.fe.max_tokens(req.max_tokens, n_prompt, "max_tokens", "messages")
        sampling, stages = self.fe.sampling(req, mt, logprobs), {}
        if req.sampling_params_list is not None:
            sampling, stages = self.fe.listed_sampling(req.sampling_params_list, sampling, n_prompt)
        preq = PipelineRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}", prompt_token_ids=prompt_ids,
                               sampling=sampling, stage_overrides=stages, modalities=modalities, voice=voice, speed=speed,
                               # stages that feed a talker capture what it needs only then
                               audio_out="audio" in modalities, num_audio_inputs=len(inputs), inputs=inputs,
                               prompt_positions=n_prompt)
        return req, preq

    async def _open_stream(self, gen: Generation, body, usage: str | None) -> Response:
        # Wait for the first output before sending headers, so early failures get a real status.
        await gen.start()
        return ClosingStream(body(gen, usage), media_type="text/event-stream", headers=sse.HEADERS, stopping=STOPPING)

    def _chunk(self, gen: Generation, obj: str, choice: dict | None, usage: dict | None = None,
               modality: str | None = None) -> bytes:
        d = {"id": gen.id, "object": obj, "created": gen.created, "model": self.fe.model,
             "choices": [choice] if choice is not None else []}
        if modality is not None:
            d["modality"] = modality
        if usage is not None:
            d["usage"] = usage
        return sse.event(d)

    async def _chat_stream(self, gen: Generation, usage: str | None, wav_chunks: bool = False):
        audio_id = f"audio-{gen.id}"
        obj = "chat.completion.chunk"
        running = usage == "continuous"
        # Audio asked for: the closing audio record (its transcript), also when nothing was speakable.
        spoken = gen.audio is not None

        def chunk(delta, finish=None, logprobs=None, modality="text"):
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = gen.stop_reason   # only on the finishing chunk, as vLLM sends it
            # vllm-omni's `modality` on every chunk, text-only too: its example client prints only "text" ones
            return self._chunk(gen, obj, choice, gen.usage() if running else None, modality)

        try:
            yield chunk({"role": "assistant", "content": ""})
            async for ev in gen.events():
                if ev[0] == "text":
                    yield chunk({"content": ev[1]}, None, self._chat_logprobs(gen, last=False))
                elif ev[0] == "audio":
                    if wav_chunks:
                        data, fmt = wav_bytes(ev[1], ev[2]), "wav"
                    else:
                        data, fmt = pcm16(ev[1]), "pcm16"
                    b64 = base64.b64encode(data).decode()
                    delta = {"audio": {"id": audio_id, "data": b64, "format": fmt, "sample_rate": ev[2]}}
                    if wav_chunks:    # vllm-omni's clients read an audio chunk's delta.content
                        delta = {"content": b64, **delta}
                    yield chunk(delta, modality="audio")
                else:
                    # The finishing chunk: the last token's text ("" too, as vLLM's), with audio the closing record.
                    delta = {"content": ev[1]}
                    if spoken:
                        delta["audio"] = {"id": audio_id, "transcript": gen.text,
                                          "expires_at": int(time.time()) + AUDIO_TTL_S}
                    yield chunk(delta, gen.finish_reason, self._chat_logprobs(gen, last=True))
            if usage is not None:
                yield self._chunk(gen, obj, None, gen.usage())
        except Exception as e:  # after the headers went out, an error is an event in the stream
            err = to_api_error(e)
            yield sse.event(error_body(err.message, err.type, err.param, err.code))
        yield sse.DONE

    async def _chat_full(self, gen: Generation, fmt: str = "wav", openai: bool = True) -> Response:
        """`fmt`: audio.format, "wav" (a whole file), "pcm16" (raw s16le, as OpenAI returns it) or a whole
        mp3, flac, opus (Ogg) or aac (ADTS) file (omni/audio_encode.py).
        `openai`: the request sent OpenAI's `audio` object. With text and audio and no such object,
        vllm-omni's shape: a text choice, then an audio choice (both index 0, as vllm-omni numbers them:
        message.audio, content null, transcript "" as the text is the first choice's, finish_reason
        "stop"); its example clients (which send no `audio`) read each choice's audio or else its content.
        Else OpenAI's: one choice, content null, message.audio with the text as its transcript."""
        await gen.start()
        audio = bytearray()
        async for ev in gen.events():
            if ev[0] == "audio":
                audio += ev[1]
        # vllm-omni's separate text choice only for its clients: OpenAI's read choices[0].message.audio
        with_text = "text" in gen.request.modalities and not (openai and gen.audio is not None)
        choices = []
        if with_text:
            choices.append({"index": 0, "message": {"role": "assistant", "content": gen.text},
                            "logprobs": self._chat_logprobs(gen, last=False),
                            "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason})
        if gen.audio is not None:     # asked for: also with nothing speakable (no data), for its transcript
            pcm = bytes(audio)
            if not pcm:
                data = b""
            elif fmt in FORMATS:     # a thread: minutes of speech are seconds of encoding
                data = (await asyncio.to_thread(encode, fmt, pcm, gen.sample_rate))[0]
            else:
                data = pcm16(pcm) if fmt == "pcm16" else wav_bytes(pcm, gen.sample_rate)
            record = {"id": f"audio-{gen.id}", "data": base64.b64encode(data).decode(), "format": fmt,
                      "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": "" if with_text else gen.text}
            if fmt == "pcm16" and gen.sample_rate:
                record["sample_rate"] = gen.sample_rate    # raw samples do not say it
            choices.append({"index": 0, "message": {"role": "assistant", "content": None, "audio": record},
                            "logprobs": None if with_text else self._chat_logprobs(gen, last=False),
                            "finish_reason": "stop" if with_text else gen.finish_reason,
                            "stop_reason": None if with_text else gen.stop_reason})
        body = {"id": gen.id, "object": "chat.completion", "created": int(time.time()),
                "model": self.fe.model, "choices": choices, "usage": gen.usage()}
        return Response(msgspec.json.encode(body), media_type="application/json")

    def _chat_logprobs(self, gen: Generation, last: bool) -> dict | None:
        """The logprobs of the tokens since the last call; on the finishing chunk only if any are left."""
        entries = gen.take_logprobs() if gen.want_logprobs else []
        return LP.chat(self.fe.tokenizer, entries) if gen.want_logprobs and (entries or not last) else None

    def _completion_logprobs(self, gen: Generation, offset: int, last: bool) -> dict | None:
        entries = gen.take_logprobs() if gen.want_logprobs else []
        return (LP.completion(self.fe.tokenizer, entries, offset)
                if gen.want_logprobs and (entries or not last) else None)

    async def completions(self, request: Request) -> Response:
        req, preq = prepared(request) or await self.completion_request(await request.body())
        gen = Generation(self.fe.orch, preq, decode=self.fe.decode, prompt_ids=preq.prompt_token_ids,
                         stops=P.stop_list(req.stop), include_stop=bool(req.include_stop_str_in_output),
                         metrics=self.fe.metrics, route="/v1/completions",
                         t0=self.fe.t0(request), eos_token_id=self.fe.tokenizer.eos_token_id,
                         response_id=answer_id(request, req, "cmpl"))
        if req.stream:
            return await until_disconnect(
                request, lambda: self._open_stream(gen, self._completion_stream, usage_mode(req.stream_options)))
        return await until_disconnect(request, lambda: self._completion_full(gen))

    async def completion_request(self, raw: bytes) -> tuple[P.CompletionRequest, PipelineRequest]:
        """As chat_request, for completions."""
        self.fe.need_text()
        req = P.decode_body(raw, P.CompletionRequest)
        self.fe.check_model(req.model)
        logprobs = P.check_sampling(req)
        prompt = P.one_prompt(req.prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", param="prompt")
            self.fe.check_prompt_chars(len(prompt), "prompt", "prompt")
            prompt_ids = list(await self.fe.offload(len(prompt) > OFFLOAD_CHARS, self.fe.encode, prompt,
                                                    req.add_special_tokens))
        else:
            prompt_ids = list(prompt)
            if not prompt_ids:
                raise bad_request("prompt must not be empty", param="prompt")
        # vLLM's and OpenAI's default for completions is 16 tokens (chat's is the deploy's)
        mt = self.fe.max_tokens(req.max_tokens, len(prompt_ids), "max_tokens", "prompt", default=16)   # length first
        if not isinstance(prompt, str):
            self.fe.check_token_ids(prompt_ids, "prompt token id", "prompt")
        self.fe.check_placeholders(prompt_ids, 0, "prompt")
        preq = PipelineRequest(request_id=f"cmpl-{uuid.uuid4().hex}", prompt_token_ids=prompt_ids,
                               sampling=self.fe.sampling(req, mt, logprobs))
        return req, preq

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize; frontend work only (no stage is involved)."""
        self.fe.need_text()
        raw = await request.body()
        req = P.decode_body(raw, P.TokenizeRequest)
        self.fe.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of `prompt` and `messages`", param="prompt")
        # Like the generation routes, a text that cannot fit the context is refused untokenized:
        # tokenizing 10 MB takes the tokenizer thread (one per frontend) for many seconds.
        if req.messages is not None:
            self.fe.check_message_count(len(req.messages))
            messages = P.chat_messages(req)
            chars = content_chars(messages)
            self.fe.check_prompt_chars(chars, "messages", "messages")
            kwargs = self.fe.template_kwargs(req.chat_template_kwargs)
            ids = await self.fe.offload(max(chars, len(raw)) > OFFLOAD_CHARS, self.fe.render_chat, messages,
                                        kwargs, P.chat_ending(req), bool(req.add_special_tokens))
        else:
            self.fe.check_prompt_chars(len(req.prompt), "prompt", "prompt")
            ids = list(await self.fe.offload(len(req.prompt) > OFFLOAD_CHARS, self.fe.encode, req.prompt,
                                           req.add_special_tokens is not False))
        body = {"count": len(ids), "max_model_len": self.fe.max_model_len, "tokens": ids,
                "token_strs": self.fe.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}
        # msgspec: json.dumps of 150k ids holds the loop for ~0.1 s
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        self.fe.need_text()
        req = P.decode_body(await request.body(), P.DetokenizeRequest)
        self.fe.check_model(req.model)
        self.fe.check_token_ids(req.tokens, "token id", "tokens")
        text = await self.fe.offload(len(req.tokens) > OFFLOAD_CHARS // 4, self.fe.tokenizer.decode, req.tokens)
        return JSONResponse({"prompt": text})

    async def _completion_stream(self, gen: Generation, usage: str | None):
        running = usage == "continuous"
        offset = 0     # text_offset of the next token: by the tokens reported, as vLLM counts

        def chunk(text, finish, logprobs):
            # vLLM's completions stream carries stop_reason on every chunk (null until the end)
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": gen.stop_reason if finish is not None else None}
            return self._chunk(gen, "text_completion", choice, gen.usage() if running else None)

        try:
            async for ev in gen.events():
                if ev[0] == "audio":
                    continue
                end = ev[0] == "end"
                lp = self._completion_logprobs(gen, offset, last=end)
                if lp and lp["tokens"]:
                    offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
                yield chunk(ev[1], gen.finish_reason if end else None, lp)
            if usage is not None:
                yield self._chunk(gen, "text_completion", None, gen.usage())
        except Exception as e:
            err = to_api_error(e)
            yield sse.event(error_body(err.message, err.type, err.param, err.code))
        yield sse.DONE

    async def _completion_full(self, gen: Generation) -> Response:
        await gen.start()
        async for _ in gen.events():
            pass
        body = {"id": gen.id, "object": "text_completion", "created": int(time.time()),
                "model": self.fe.model,
                "choices": [{"index": 0, "text": gen.text, "logprobs": self._completion_logprobs(gen, 0, last=False),
                             "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason}],
                "usage": gen.usage()}
        return Response(msgspec.json.encode(body), media_type="application/json")

