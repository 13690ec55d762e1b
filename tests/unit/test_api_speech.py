"""The speech route, voices and audio in a chat, against the fake orchestrator (split from test_api.py)."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest

from omni.api import InMemoryVoiceStore, build_app

from tests.unit.api_fakes import (  # noqa: F401 (fixtures)
    FakeOrchestrator, anyio_backend, assert_error, chat_body, make, sse_events, tokenizer)

pytestmark = pytest.mark.anyio


def _wav_info(data: bytes):
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    channels, rate = struct.unpack("<HI", data[22:28])
    bits = struct.unpack("<H", data[34:36])[0]
    n = struct.unpack("<I", data[40:44])[0]
    return channels, rate, bits, n


async def test_speech(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 3
    r = await c.post("/v1/audio/speech", json={"input": "hi there", "voice": "joe", "speed": 1.5})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav", r.text
    assert _wav_info(r.content) == (1, 22050, 16, 600)
    assert r.headers["x-sample-rate"] == "22050"
    assert struct.unpack("<h", r.content[44:46])[0] == round(0.5 * 32767)
    req = orch.requests[0]
    assert req.text == "hi there" and req.entry_stage == 1 and req.modalities == ("audio",)
    assert req.voice == "joe" and req.speed == 1.5
    r = await c.post("/v1/audio/speech", json={"input": "hi", "response_format": "pcm"})
    assert r.headers["content-type"] == "audio/pcm" and len(r.content) == 600
    assert_error(await c.post("/v1/audio/speech", json={"input": "hi", "speed": 9}), 400, "speed")
    assert_error(await c.post("/v1/audio/speech", json={"input": "hi", "response_format": "ogg"}), 400,
                 "response_format")     # mp3, flac, opus, aac: test_audio_formats
    assert_error(await c.post("/v1/audio/speech", json={"input": "hi", "voice": "nobody"}), 404, "voice")
    assert_error(await c.post("/v1/audio/speech", json={"voice": "joe"}), 400, "input")


async def test_speech_absent_without_talker(tokenizer):
    _, c = make(tokenizer)
    assert_error(await c.post("/v1/audio/speech", json={"input": "hi"}), 404)
    assert_error(await c.get("/v1/audio/voices"), 404)


async def test_speech_only_pipeline_without_tokenizer(tokenizer):
    orch = FakeOrchestrator(tokenizer)
    orch.audio_chunks = 1
    app = build_app(orch, None, served_model_name="tts", max_model_len=0, speech_entry_stage=0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert_error(await c.post("/v1/chat/completions", json=chat_body(model="tts")), 404, None, "no text model")
        r = await c.post("/v1/audio/speech", json={"input": "hi", "model": "tts"})
        assert r.status_code == 200 and _wav_info(r.content)[3] == 200


class ListOnlyVoices(InMemoryVoiceStore):
    get = None  # a store without get(): the frontend searches list()


async def test_voice_store_without_get(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1, voices=ListOnlyVoices())
    orch.audio_chunks = 1
    assert (await c.post("/v1/audio/speech", json={"input": "hi"})).status_code == 200
    assert_error(await c.post("/v1/audio/speech", json={"input": "hi", "voice": "zed"}), 404, "voice", "joe")


async def test_voices(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1, voices=InMemoryVoiceStore(("joe", "amy")))
    names = [v["name"] for v in (await c.get("/v1/audio/voices")).json()["data"]]
    assert names == ["joe", "amy"]
    r = await c.post("/v1/audio/voices", json={"name": "slow-joe", "base": "joe", "speed": 0.5})
    assert r.status_code == 201 and r.json()["base"] == "joe"
    assert_error(await c.post("/v1/audio/voices", json={"name": "slow-joe"}), 409, None, "exists")
    assert_error(await c.post("/v1/audio/voices", json={"name": "x", "base": "zed"}), 400, "base")
    assert_error(await c.post("/v1/audio/voices", json={"name": "bad name!"}), 400, "name")
    orch.audio_chunks = 1
    await c.post("/v1/audio/speech", json={"input": "hi", "voice": "slow-joe", "speed": 2.0})
    assert (orch.requests[-1].voice, orch.requests[-1].speed) == ("joe", 1.0)
    assert_error(await c.delete("/v1/audio/voices/joe"), 409, None, "built in")
    assert_error(await c.delete("/v1/audio/voices/nope"), 404)
    assert (await c.delete("/v1/audio/voices/slow-joe")).status_code == 200
    assert [v["name"] for v in (await c.get("/v1/audio/voices")).json()["data"]] == ["joe", "amy"]


async def test_chat_with_audio(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 2
    body = chat_body(modalities=["text", "audio"], audio={"voice": "joe", "format": "wav"})
    d = (await c.post("/v1/chat/completions", json=body)).json()
    (choice,) = d["choices"]               # OpenAI's shape (an `audio` object): one choice, the text its transcript
    msg = choice["message"]
    assert msg["content"] is None and msg["audio"]["transcript"] == "hello world"
    assert _wav_info(base64.b64decode(msg["audio"]["data"])) == (1, 22050, 16, 400)
    assert orch.requests[0].modalities == ("text", "audio") and orch.requests[0].voice == "joe"
    assert orch.requests[0].audio_out is True     # a thinker feeding a talker captures its rows only then
    evs = sse_events((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
    audio = [e["choices"][0]["delta"]["audio"] for e in evs if e["choices"] and "audio" in e["choices"][0]["delta"]]
    assert [len(base64.b64decode(a["data"])) for a in audio[:-1]] == [200, 200]
    assert audio[-1]["transcript"] == "hello world"
    # The closing audio record is the last chunk and the one that finishes.
    chunks = [e["choices"][0] for e in evs if e["choices"]]
    assert [ch["finish_reason"] for ch in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    # its content "" (the EOS has no text), as vLLM's finishing chunk and vllm-omni's example client reads it
    assert chunks[-1]["delta"] == {"content": "", "audio": audio[-1]}
    assert set(audio[-1]) == {"id", "transcript", "expires_at"}
    assert_error(await c.post("/v1/chat/completions", json={**body, "audio": {"format": "ogg"}}), 400,
                 "audio.format")


def test_chat_and_speech_take_one_voice_field():
    """One type for OpenAI's voice (a name or {"id": name}) in chat's audio and speech, one reading of it."""
    from typing import get_type_hints

    from omni.api import protocol as P

    def voice(t):
        return get_type_hints(t, include_extras=True)["voice"]
    assert voice(P.SpeechRequest) == voice(P.AudioOptions) == P.Voice
    assert P.voice_name(P.VoiceId("amy")) == P.voice_name("amy") == "amy" and P.voice_name(None) is None
