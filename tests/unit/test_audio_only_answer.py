"""An answer asked for as audio: its text comes back as the audio's transcript also when nothing of it
was speakable (zero audio), streamed or not; the frontend's time to first output times the first
audio, not the transcript's text that reaches the frontend before it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from omni.api import generation
from omni.api.generation import Generation
from omni.api.metrics import FrontendMetrics
from omni.engines.base import SamplingParams
from omni.orchestrator.types import PipelineOutput, PipelineRequest
from tests.unit.api_fakes import anyio_backend, chat_body, make, sse_events, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("fmt", ["wav", "pcm16"])
async def test_an_audio_only_answer_with_nothing_speakable_keeps_its_transcript(tokenizer, fmt):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1, reply=".....")
    orch.audio_chunks = 0          # the talker found nothing to speak: zero audio
    body = chat_body(modalities=["audio"], audio={"voice": "joe", "format": fmt})
    d = (await c.post("/v1/chat/completions", json=body)).json()
    assert len(d["choices"]) == 1      # audio only: the audio choice alone, its transcript the text
    msg = d["choices"][0]["message"]
    assert msg["content"] is None and d["usage"]["completion_tokens"] > 0
    assert msg["audio"]["transcript"] == "....." and msg["audio"]["data"] == ""
    assert msg["audio"]["format"] == fmt and msg["audio"]["id"] == f"audio-{d['id']}"
    evs = sse_events((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
    chunks = [e["choices"][0] for e in evs if e["choices"]]
    assert chunks[-1]["finish_reason"] == "stop"
    assert chunks[-1]["delta"]["audio"]["transcript"] == "....."
    assert not any(ch["delta"].get("content") for ch in chunks)       # audio only: no text


async def test_text_and_audio_with_nothing_speakable_closes_with_the_audio_record(tokenizer):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    body = chat_body(modalities=["text", "audio"], audio={"voice": "joe", "format": "wav"})
    (choice,) = (await c.post("/v1/chat/completions", json=body)).json()["choices"]    # OpenAI's shape
    assert choice["message"]["content"] is None
    assert choice["message"]["audio"]["transcript"] == "hello world" and choice["message"]["audio"]["data"] == ""
    vllm_omni = {k: v for k, v in body.items() if k != "audio"}    # its clients send no audio object
    choices = (await c.post("/v1/chat/completions", json=vllm_omni)).json()["choices"]
    assert choices[0]["message"]["content"] == "hello world"
    assert choices[1]["message"]["audio"]["transcript"] == "" and choices[1]["message"]["audio"]["data"] == ""
    evs = sse_events((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
    assert [e["choices"][0]["delta"]["audio"]["transcript"] for e in evs
            if e["choices"] and "audio" in e["choices"][0]["delta"]] == ["hello world"]


class Timed:
    """The thinker's text at t=1 s and 2 s (where it ends when `audio` is False), then the first audio at t=5 s."""

    def __init__(self, clock: list[float], audio: bool = True):
        self.clock, self.audio = clock, audio

    async def generate(self, req):
        for t, tok in ((1.0, 104), (2.0, 105)):
            self.clock[0] = t
            yield PipelineOutput(request_id=req.request_id, stage_id=0, modality="text", token_ids=[tok],
                                 finished=not self.audio and t == 2.0, finish_reason="stop")
        if self.audio:
            self.clock[0] = 5.0
            yield PipelineOutput(request_id=req.request_id, stage_id=2, modality="audio", sample_rate=24000,
                                 audio_pcm=np.zeros(8, dtype="<f4").tobytes(), finished=True,
                                 finish_reason="stop")

    def end_text(self, request_id):
        pass


@pytest.mark.parametrize("modalities, audio, first", [(("audio",), True, 5.0), (("text", "audio"), True, 1.0),
                                                        (("text",), False, 1.0), (("audio",), False, 2.0)])
def test_the_time_to_first_output_is_that_of_the_first_output_asked_for(monkeypatch, modalities, audio, first):
    clock = [0.0]
    monkeypatch.setattr(generation, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: 0.0))
    metrics = FrontendMetrics()
    req = PipelineRequest(request_id="r1", prompt_token_ids=[1], modalities=modalities,
                          sampling=SamplingParams(max_tokens=8))
    gen = Generation(Timed(clock, audio), req, decode=lambda t: "".join(map(chr, t)), prompt_ids=[1], stops=[],
                     metrics=metrics, route="/v1/chat/completions", t0=0.0)

    async def run():
        await gen.start()
        return [e async for e in gen.events()]
    asyncio.run(run())
    h = metrics.ttfo["/v1/chat/completions"]
    assert (sum(h.counts), h.sum) == (1, first)
    assert gen.text == "hi"
