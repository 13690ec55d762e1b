"""/v1/audio/speech: text in, WAV, mp3, FLAC, Ogg Opus or AAC (ADTS) (whole, or streamed as it is made with
`stream_format`), or raw s16le PCM (streamed as it is made) out. The compressed formats are encoded by
omni/audio_encode.py; streamed, the chunks' bytes in order are the file.

A stream that fails after its headers went out: the SSE form ends with vllm-omni's
`speech.audio.error` event; the raw form ends without its last chunk (a client reads an incomplete
body, not a short file, as raw audio has no place for an error). Either is one log line.
The server's stop ends them the same way (the error: server_shutting_down)."""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import Response

from omni.api import protocol as P
from omni.api import sse
from omni.api.audio_metrics import AudioStream
from omni.api.errors import APIError, bad_request, error_body, to_api_error
from omni.api.generation import Generation
from omni.api.http import SHUTTING_DOWN, ClosingStream, until_disconnect
from omni.api.job_prepared import prepared
from omni.api.refused import first_refused
from omni.api.state import FrontendState
from omni.api.wav import pcm16, streaming_wav_header, wav_bytes
from omni.audio_encode import FORMATS, Encoder, encode
from omni.orchestrator.types import PipelineRequest

log = logging.getLogger(__name__)


CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", **{k: f.content_type for k, f in FORMATS.items()}}


class _Broken(Exception):
    """The raw stream failed part-way: already logged, the response ends without its last chunk."""


class RawAudioStream(ClosingStream):
    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except _Broken:
            pass     # returning without the final chunk: Hypercorn closes the connection mid-body


def _failed(request_id: str, form: str, e: Exception):
    err = to_api_error(e)
    log.warning("%s (speech, %s): failed part-way, %s: %s", request_id, form, err.type, err.message)
    return err


def _error_event(err: APIError, sent: bool) -> sse.Last:
    """vllm-omni's speech.audio.error, the SSE form's last event (it sends no [DONE])."""
    error = error_body(err.message, err.type, err.param, err.code)["error"]
    if sent:    # vllm-omni's words for "the audio so far is not the answer"
        error.update(partial_audio=True, action="discard")
    return sse.Last(sse.event({"type": "speech.audio.error", "error": error}))


class SpeechRoutes:
    def __init__(self, fe: FrontendState):
        self.fe = fe

    async def speech(self, request: Request) -> Response:
        req, preq = prepared(request) or await self.speech_request(await request.body())   # a job's: at its submit
        as_sse = req.stream_format == "sse" or (req.stream and req.stream_format is None)
        as_raw = not as_sse and (req.response_format == "pcm" or req.stream_format == "audio")
        audio = AudioStream(self.fe.metrics.audio, self.fe.model, preq.voice,
                            self.fe.t0(request), streamed=as_sse or as_raw)
        gen = Generation(self.fe.orch, preq, decode=self.fe.decode, prompt_ids=[], stops=[], metrics=self.fe.metrics,
                         route="/v1/audio/speech", t0=self.fe.t0(request), audio=audio)

        async def stream_pcm() -> Response:
            # The bytes as they are made (OpenAI's stream_format "audio"; pcm: raw s16le): the first leave with
            # the first chunk, not with the last. A WAV answer needs its length up front.
            await _started(gen)
            enc = _encoder(req.response_format, gen.first_sample_rate)

            async def body():
                if req.response_format == "wav":      # stream_format "audio" with wav: a header of unknown length
                    yield streaming_wav_header(gen.first_sample_rate)
                try:
                    async with aclosing(_chunks(gen, enc, pcm16, raw=True)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                except Exception as e:
                    _failed(preq.request_id, "raw audio", e)
                    raise _Broken from None
            return RawAudioStream(body(), media_type=CONTENT_TYPES[req.response_format],
                                  headers={"X-Sample-Rate": str(enc.rate if enc else gen.first_sample_rate)})

        async def stream_sse() -> Response:
            # OpenAI's stream_format "sse": speech.audio.delta events (base64 of the chunk: s16le for pcm, a whole
            # WAV file each for wav, the encoder's next bytes for the others: the deltas in order are the file),
            # then speech.audio.done with usage, or speech.audio.error.
            await _started(gen)
            sent = False     # audio went out: an error event then says to discard it
            enc = _encoder(req.response_format, gen.first_sample_rate)

            def delta(chunk: bytes) -> bytes:
                nonlocal sent
                sent = True
                return sse.event({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})

            def plain(pcm: bytes) -> bytes:
                return pcm16(pcm) if req.response_format == "pcm" else wav_bytes(pcm, gen.sample_rate)

            async def body():
                try:
                    async with aclosing(_chunks(gen, enc, plain, raw=False)) as chunks:
                        async for chunk in chunks:
                            yield delta(chunk)
                except Exception as e:
                    yield _error_event(_failed(preq.request_id, "sse", e), sent)
                    return
                yield sse.Last(sse.event({"type": "speech.audio.done", "usage": speech_usage(gen)}))
            rate = enc.rate if enc else gen.first_sample_rate
            return ClosingStream(body(), media_type="text/event-stream",
                                 headers={**sse.HEADERS, "X-Sample-Rate": str(rate or "")},
                                 stopping=lambda: _error_event(SHUTTING_DOWN, sent))

        if as_sse:
            return await until_disconnect(request, stream_sse)
        if as_raw:
            return await until_disconnect(request, stream_pcm)

        async def work() -> Response:
            await gen.start()
            audio = bytearray()
            async for ev in gen.events():
                if ev[0] == "audio":
                    audio += ev[1]
            if not audio:
                raise APIError(500, "the pipeline finished without producing audio", type="stage_error")
            if req.response_format in FORMATS:    # a thread: minutes of speech are seconds of encoding
                data, rate = await asyncio.to_thread(encode, req.response_format, bytes(audio), gen.sample_rate)
            else:
                data, rate = wav_bytes(bytes(audio), gen.sample_rate), gen.sample_rate
            return Response(data, media_type=CONTENT_TYPES[req.response_format], headers={"X-Sample-Rate": str(rate)})

        return await until_disconnect(request, work)

    async def speech_request(self, raw: bytes) -> tuple[P.SpeechRequest, PipelineRequest]:
        """The body and its pipeline request, or the 4xx the route answers before running anything (a job's
        submit runs this too)."""
        self.fe.need_speech()
        req = P.decode_body(raw, P.SpeechRequest)
        self.fe.check_model(req.model)
        if not req.input.strip():
            raise bad_request("input must not be empty", param="input")
        if "\x00" in req.input:
            raise bad_request("input contains a NUL character (\\u0000)", param="input")
        if len(req.input) > self.fe.max_speech_chars:
            raise bad_request(f"input is {len(req.input)} characters; the limit is {self.fe.max_speech_chars}",
                              param="input")
        if req.response_format not in P.SPEECH_FORMATS:
            raise bad_request(f"response_format `{req.response_format}` is not supported "
                              f"({', '.join(P.SPEECH_FORMATS)})", param="response_format")
        speed = 1.0 if req.speed is None else req.speed
        P.check_speed(speed)
        refused = first_refused(req, P.SPEECH_REFUSED)
        if refused is not None:
            raise bad_request(f"{refused[0]} is not supported: {refused[1]}", param=refused[0])
        named = {"voice": P.voice_name(req.voice), "speaker": req.speaker}
        voice, speed = await self.fe.voice(P.one_voice(named), speed, param=P.voice_field(named))
        return req, PipelineRequest(request_id=f"speech-{uuid.uuid4().hex}", text=req.input,
                                    entry_stage=self.fe.speech_stage, modalities=("audio",), voice=voice, speed=speed)


async def _started(gen: Generation) -> None:
    """A stream's generation started; a pipeline that ended without audio is a 500, as the whole answer's."""
    await gen.start()
    if not gen.first_sample_rate:
        await gen.close()
        raise APIError(500, "the pipeline finished without producing audio", type="stage_error")


def _encoder(fmt: str, sample_rate: int) -> Encoder | None:
    """A stream's encoder; its writes run on threads (mp3: ~15 ms of CPU a second of audio, off the loop)."""
    return Encoder(fmt, sample_rate) if fmt in FORMATS else None


async def _chunks(gen: Generation, enc: Encoder | None, plain: Callable[[bytes], bytes], *,
                  raw: bool) -> AsyncIterator[bytes]:
    """A stream's audio in its format, chunk by chunk: the encoder's next bytes (written on a thread; it may
    hold a whole chunk back, so none is sent) then its tail, or `plain` of each chunk. The raw form also passes
    an empty chunk on as one (`plain`'s b""); SSE has no empty delta. The encoder is closed however it ends."""
    try:
        async for ev in gen.events():
            if ev[0] != "audio" or not (ev[1] or raw):
                continue
            chunk = await asyncio.to_thread(enc.write, ev[1]) if enc else plain(ev[1])
            if chunk or not enc:
                yield chunk
        tail = await asyncio.to_thread(enc.close) if enc else b""
        if tail:
            yield tail
    finally:
        _close(enc)


def _close(enc: Encoder | None) -> None:
    """A stream's encoder, also when it ended early (FFmpeg's buffers are not left to the collector)."""
    if enc is not None:
        try:
            enc.close()
        except Exception as e:   # the stream's own error, if any, is what the client is told
            log.debug("closing a speech encoder: %s", e)


def speech_usage(gen: Generation) -> dict:
    """speech.audio.done's usage: the input as the speech stage counted it (vllm-omni's input_tokens: the
    text's tokens, or a phoneme stage's phonemes) and the audio's seconds. The stage's output tokens (codec
    frames) do not reach the frontend, so output_tokens and total_tokens are left out, not made up."""
    u: dict = {} if gen.engine_prompt_tokens is None else {"input_tokens": gen.engine_prompt_tokens}
    if gen.audio is not None:
        u.update(gen.audio.usage())
    return u
