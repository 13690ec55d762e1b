"""/v1/audio/speech: text in, WAV (whole) or raw s16le PCM (streamed as it is made) out."""

from __future__ import annotations

import base64
import uuid

from starlette.requests import Request
from starlette.responses import Response

from omni.api import protocol as P
from omni.api import sse
from omni.api.audio_metrics import AudioStream
from omni.api.errors import APIError, bad_request
from omni.api.generation import Generation
from omni.api.http import ClosingStream, until_disconnect
from omni.api.refused import first_refused
from omni.api.state import FrontendState
from omni.api.wav import pcm16, streaming_wav_header, wav_bytes
from omni.orchestrator.types import PipelineRequest


class SpeechRoutes:
    def __init__(self, fe: FrontendState):
        self.fe = fe

    async def speech(self, request: Request) -> Response:
        self.fe.need_speech()
        req = P.decode_body(await request.body(), P.SpeechRequest)
        self.fe.check_model(req.model)
        if not req.input.strip():
            raise bad_request("input must not be empty", param="input")
        if "\x00" in req.input:
            raise bad_request("input contains a NUL character (\\u0000)", param="input")
        if len(req.input) > self.fe.max_speech_chars:
            raise bad_request(f"input is {len(req.input)} characters; the limit is {self.fe.max_speech_chars}",
                              param="input")
        if req.response_format not in ("wav", "pcm"):
            raise bad_request(f"response_format `{req.response_format}` is not supported (wav, pcm)",
                              param="response_format")
        P.check_speed(req.speed)
        refused = first_refused(req, P.SPEECH_REFUSED)
        if refused is not None:
            raise bad_request(f"{refused[0]} is not supported: {refused[1]}", param=refused[0])
        as_sse = req.stream_format == "sse" or (req.stream and req.stream_format is None)
        as_raw = not as_sse and (req.response_format == "pcm" or req.stream_format == "audio")
        asked = P.one_voice({"voice": req.voice.id if isinstance(req.voice, P.VoiceId) else req.voice,
                             "speaker": req.speaker})
        voice, speed = await self.fe.voice(asked, req.speed)
        preq = PipelineRequest(request_id=f"speech-{uuid.uuid4().hex}", text=req.input,
                               entry_stage=self.fe.speech_stage, modalities=("audio",), voice=voice, speed=speed)
        audio = AudioStream(self.fe.metrics.audio, self.fe.model, voice,
                            self.fe.t0(request), streamed=as_sse or as_raw)
        gen = Generation(self.fe.orch, preq, decode=self.fe.decode, prompt_ids=[], stops=[], metrics=self.fe.metrics,
                         route="/v1/audio/speech", t0=self.fe.t0(request), audio=audio)

        async def stream_pcm() -> Response:
            # Raw s16le as it is made (OpenAI's stream_format "audio"): the first bytes leave
            # with the first chunk, not with the last. A WAV answer needs its length up front.
            await gen.start()
            if not gen.first_sample_rate:
                await gen.close()
                raise APIError(500, "the pipeline finished without producing audio", type="stage_error")

            async def body():
                if req.response_format == "wav":      # stream_format "audio" with wav: a header of unknown length
                    yield streaming_wav_header(gen.first_sample_rate)
                async for ev in gen.events():
                    if ev[0] == "audio":
                        yield pcm16(ev[1])
            return ClosingStream(body(), media_type=f"audio/{req.response_format}",
                                  headers={"X-Sample-Rate": str(gen.first_sample_rate)})

        async def stream_sse() -> Response:
            # OpenAI's stream_format "sse": speech.audio.delta events (base64 of the chunk: s16le for
            # pcm, a whole WAV file each for wav), then speech.audio.done.
            await gen.start()
            if not gen.first_sample_rate:   # as the raw stream and the whole answer: no audio is a 500
                await gen.close()
                raise APIError(500, "the pipeline finished without producing audio", type="stage_error")

            async def body():
                async for ev in gen.events():
                    if ev[0] == "audio" and ev[1]:
                        chunk = pcm16(ev[1]) if req.response_format == "pcm" else wav_bytes(ev[1], gen.sample_rate)
                        yield sse.event({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
                yield sse.event({"type": "speech.audio.done"})
            return ClosingStream(body(), media_type="text/event-stream",
                                 headers={**sse.HEADERS, "X-Sample-Rate": str(gen.first_sample_rate or "")})

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
            headers = {"X-Sample-Rate": str(gen.sample_rate)}
            return Response(wav_bytes(bytes(audio), gen.sample_rate), media_type="audio/wav", headers=headers)

        return await until_disconnect(request, work)

