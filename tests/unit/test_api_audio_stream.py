"""Streamed chat audio in both shapes (OpenAI's raw pcm16, vllm-omni's WAV chunks) against the
in-memory fake orchestrator: the vllm-omni-style parse (benchmarks/omni_chat_client.py, fed the
body in small pieces) yields the same PCM as the pcm16 parse, the official `openai` types still
read every chunk, and the usage carries the audio figures."""

from __future__ import annotations

import base64
import random

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from benchmarks import omni_chat_client as oc
from tests.unit.api_fakes import chat_body, make, sse_events, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio
RATE = 22050


def pcm16_of(events: list) -> bytes:
    """Today's parser: the joined base64 `delta.audio.data` of the audio chunks."""
    return b"".join(base64.b64decode(e["choices"][0]["delta"]["audio"]["data"]) for e in events
                    if e["choices"] and "data" in (e["choices"][0]["delta"].get("audio") or {}))


def parse_like_vllm_omni(body: bytes, seed: int) -> oc.Result:
    """The body cut at random places, as a network may deliver it."""
    rnd = random.Random(seed)
    p, sse, i, t = oc.StreamParse(0.0), oc.SSEMessages(), 0, 0.0
    while i < len(body):
        n = rnd.randint(1, 700)
        for msg in sse.feed(body[i:i + n]):
            t += 0.001
            p.message(msg, t)
        i += n
    return p.finish()


async def test_vllm_omni_parse_of_wav_chunks_equals_the_pcm16_stream(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 3
    openai_style = {**chat_body(modalities=["text", "audio"], audio={"voice": "joe", "format": "pcm16"}),
                    "stream": True}
    raw = await c.post("/v1/chat/completions", json=openai_style)
    evs = sse_events(raw.text)
    pcm = pcm16_of(evs)
    assert len(pcm) == 3 * 100 * 2
    assert [e.get("modality") for e in evs if e["choices"]] == ["text"] * 4 + ["audio"] * 3 + ["text"]
    assert all(e["choices"][0]["delta"]["audio"]["format"] == "pcm16" for e in evs if e.get("modality") == "audio")
    for e in evs:
        ChatCompletionChunk.model_validate(e)       # the openai package still reads every chunk

    body = oc.payload("tiny", "say hello", 16, {"modalities": ["text", "audio"]})
    assert "audio" not in body                        # vllm-omni's client sends no audio object
    r = await c.post("/v1/chat/completions", json=body)
    wav_evs = sse_events(r.text)
    chunks = [e["choices"][0]["delta"]["audio"] for e in wav_evs if e.get("modality") == "audio"]
    assert len(chunks) == 3 and all(a["format"] == "wav" and a["sample_rate"] == RATE for a in chunks)
    for seed in range(3):
        got = parse_like_vllm_omni(r.content, seed)
        assert got.ok and got.dropped_chunks == 0 and got.pcm == pcm
        assert got.sample_rate == RATE and got.audio_frames == 300 and got.audio_duration == pytest.approx(300 / RATE)
        assert got.text == "hello world" and got.ttft > 0 and 0 < got.audio_ttfp <= got.audio_generate_time
        assert got.audio_rtf == pytest.approx(got.audio_generate_time / got.audio_duration)
        assert got.output_tokens == 3          # hello, world, EOS
    # Its usage: the tokens, and the audio as the frontend handed it out.
    final = wav_evs[-1]
    assert final["choices"] == [] and "modality" not in final
    assert final["usage"]["audio_duration_s"] == pytest.approx(300 / RATE, abs=1e-6)
    assert final["usage"]["audio_ttfp_s"] > 0
    # The pcm16 stream read the vllm-omni way: nothing decodes as WAV, so no audio is counted.
    assert parse_like_vllm_omni(raw.content, 0).dropped_chunks == 3


async def test_text_only_chunks_are_vllms_with_vllm_omnis_modality(tokenizer):
    _, c = make(tokenizer, speech_entry_stage=1)
    evs = sse_events((await c.post("/v1/chat/completions", json={**chat_body(), "stream": True,
                                                                   "stream_options": {"include_usage": True}})).text)
    # vllm-omni names every chunk's modality, text-only too (its example client prints only "text" ones);
    # the usage chunk is vLLM's own, without it
    assert [e.get("modality") for e in evs] == ["text"] * (len(evs) - 1) + [None]
    for e in evs:
        ChatCompletionChunk.model_validate(e)       # an extra key: the openai package reads every chunk
    assert set(evs[-1]["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def example_stream_loop(events: list) -> tuple[str, list[bytes]]:
    """vllm-omni's Qwen3-Omni example client's stream loop (openai_chat_completion_client_for_multimodal_
    generation.py): an audio chunk's delta.content is a WAV to save, a text chunk's content is printed."""
    printed, saved = "", []
    for e in events:
        cc = ChatCompletionChunk.model_validate(e)
        for choice in cc.choices:
            content = getattr(choice.delta, "content", None)
            modality = getattr(cc, "modality", None)
            if modality == "audio" and content:
                saved.append(base64.b64decode(content))
            elif modality == "text":
                printed += str(content)       # the client prints it as it is: None shows
    return printed, saved


@pytest.mark.parametrize("modalities", [["text"], ["text", "audio"]])
async def test_vllm_omnis_example_client_prints_the_text_and_saves_each_wav(tokenizer, modalities):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 2 if "audio" in modalities else 0     # the fake speaks whatever is asked
    body = {**chat_body(modalities=modalities), "stream": True}
    printed, saved = example_stream_loop(sse_events((await c.post("/v1/chat/completions", json=body)).text))
    assert printed == "hello world"
    assert len(saved) == orch.audio_chunks and all(w.startswith(b"RIFF") for w in saved)
    # OpenAI's clients send `audio`: raw pcm16 in delta.audio only, content never base64
    orch.audio_chunks = 2
    openai_body = {**body, "modalities": ["text", "audio"], "audio": {"voice": "joe", "format": "pcm16"}}
    evs = sse_events((await c.post("/v1/chat/completions", json=openai_body)).text)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in evs if e["choices"]) == "hello world"


async def test_whole_chat_with_audio_has_the_audio_usage(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 2
    d = (await c.post("/v1/chat/completions", json=chat_body(modalities=["text", "audio"]))).json()
    ChatCompletion.model_validate(d)
    assert d["usage"]["audio_duration_s"] == pytest.approx(200 / RATE, abs=1e-6)
    assert d["usage"]["audio_ttfp_s"] > 0 and d["usage"]["completion_tokens"] == 3
    text = (await c.get("/metrics")).text
    # A whole response counts its seconds and RTF; time to first audio is a stream's figure.
    assert 'vllm_omni:audio_duration_s_count{model_name="tiny",voice="joe",frontend="0"} 1' in text
    assert 'vllm_omni:audio_rtf_count{model_name="tiny",voice="joe",frontend="0"} 1' in text
    assert "vllm_omni:audio_ttfp_s_count" not in text


async def test_speech_streams_count_first_audio_once(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 4
    for fmt in ("pcm", "pcm", "wav"):
        r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": "joe", "response_format": fmt})
        assert r.status_code == 200
    text = (await c.get("/metrics")).text
    assert 'vllm_omni:audio_ttfp_s_count{model_name="tiny",voice="joe",frontend="0"} 2' in text
    assert 'vllm_omni:audio_duration_s_count{model_name="tiny",voice="joe",frontend="0"} 3' in text
    total = float(next(line.split()[-1] for line in text.splitlines()
                       if line.startswith("vllm_omni:audio_duration_s_sum")))
    assert total == pytest.approx(3 * 400 / RATE)
