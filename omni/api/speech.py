"""/v1/audio/speech: text in, WAV (whole) or raw s16le PCM (streamed as it is made) out."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from omni.api import protocol as P
from omni.api.errors import APIError, bad_request
from omni.api.generation import Generation
from omni.api.http import ClosingStream, until_disconnect
from omni.api.state import FrontendState
from omni.api.wav import pcm16, wav_bytes
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
        voice, speed = await self.fe.voice(req.voice, req.speed)
        preq = PipelineRequest(request_id=f"speech-{uuid.uuid4().hex}", text=req.input,
                               entry_stage=self.fe.speech_stage, modalities=("audio",), voice=voice, speed=speed)
        gen = Generation(self.fe.orch, preq, decode=self.fe.decode, prompt_ids=[], stops=[], metrics=self.fe.metrics,
                         route="/v1/audio/speech", t0=self.fe.t0(request))

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
            return ClosingStream(body(), media_type="audio/pcm",
                                  headers={"X-Sample-Rate": str(gen.first_sample_rate)})

        if req.response_format == "pcm":
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

