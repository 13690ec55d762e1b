"""/v1/audio/speech as OpenAI's and vllm-omni's clients send it: `stream` / `stream_format` (SSE events
or the raw bytes), the voice as `speaker` or `{"id": ...}`, and their other fields refused by name."""

import base64
import json
import re

import pytest

from omni.api.errors import to_api_error
from omni.errors import StageFailed
from tests.unit.api_fakes import assert_error, make, tokenizer  # noqa: F401 (a fixture)
from tests.unit.test_api_speech import _wav_info

pytestmark = pytest.mark.anyio


def events(body: str) -> list[dict]:
    frames = [f for f in body.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    return [json.loads(f[6:]) for f in frames]


@pytest.mark.parametrize("body", [{"stream": True, "response_format": "pcm"}, {"stream_format": "sse", "response_format": "pcm"}])
async def test_sse_streams_speech_audio_delta_events_then_done(tokenizer, body):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 3
    r = await c.post("/v1/audio/speech", json={"input": "hi there", **body})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    evs = events(r.text)
    assert [e["type"] for e in evs] == ["speech.audio.delta"] * 3 + ["speech.audio.done"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in evs[:3])
    raw = await c.post("/v1/audio/speech", json={"input": "hi there", "response_format": "pcm", "stream_format": "audio"})
    assert pcm == raw.content and len(pcm) == 600            # the same s16le as the raw stream


async def test_sse_with_wav_sends_a_whole_wav_per_chunk(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 2
    evs = events((await c.post("/v1/audio/speech", json={"input": "hi", "stream": True})).text)
    assert [_wav_info(base64.b64decode(e["audio"])) for e in evs[:-1]] == [(1, 22050, 16, 200)] * 2   # 100 samples, s16le


async def test_the_voice_as_speaker_or_an_id_object(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 1
    for body in ({"speaker": "joe"}, {"voice": {"id": "joe"}}, {"voice": "joe", "speaker": "JOE"},
                 {"voice": "joe", "speaker": " joe "}, {}):   # blanks aside, as a chat's voice fields
        r = await c.post("/v1/audio/speech", json={"input": "hi", **body})
        assert r.status_code == 200, r.text
        assert orch.requests[-1].voice == "joe"
    assert_error(await c.post("/v1/audio/speech", json={"input": "hi", "voice": "joe", "speaker": "amy"}), 400,
                 "voice", "voice and speaker name different voices")
    assert_error(await c.post("/v1/audio/speech", json={"input": "hi", "speaker": "nobody"}), 404, "speaker")


@pytest.mark.parametrize("body", [{"stream": True}, {"stream_format": "audio", "response_format": "pcm"}, {}])
async def test_a_pipeline_that_makes_no_audio_is_a_500_on_every_speech_answer(tokenizer, body):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 0   # the pipeline ends without an audio output
    assert_error(await c.post("/v1/audio/speech", json={"input": "hi", **body}), 500, None,
                 "the pipeline finished without producing audio")   # SSE ended with only its done event


@pytest.mark.parametrize("field, value, contains", [
    ("instructions", "Speak cheerfully", "voices take no style instructions"),
    ("task_type", "Base", "vllm-omni's Qwen3-TTS option"),
    ("ref_audio", "data:audio/wav;base64,AAAA", "voice cloning is not supported"),
    ("sample_rate", 16000, "the audio comes at the model's own rate"),
    ("seed", 3, "not sampled from a seed"),
])
async def test_fields_this_speech_stage_cannot_honour_are_refused_by_name(tokenizer, field, value, contains):
    orch, c = make(tokenizer, speech_entry_stage=1)
    r = await c.post("/v1/audio/speech", json={"input": "hi", field: value})
    assert_error(r, 400, field, contains)
    assert orch.requests == []


async def test_raw_streaming_of_wav_sends_a_header_of_unknown_length_then_the_samples(tokenizer):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 3
    r = await c.post("/v1/audio/speech", json={"input": "hi", "stream_format": "audio"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    whole = await c.post("/v1/audio/speech", json={"input": "hi"})
    assert r.content[44:] == whole.content[44:] and r.content[:4] == b"RIFF" and r.content[40:44] == b"\xff" * 4
    assert r.content[8:40] == whole.content[8:40]          # the same format chunk


@pytest.mark.parametrize("body, streamed", [
    ({"response_format": "wav", "stream_format": "audio"}, True),   # raw wav: sent chunk by chunk too
    ({"response_format": "pcm"}, True),
    ({"stream": True}, True),
    ({"response_format": "wav"}, False),                              # whole: no time to first audio
])
async def test_time_to_first_audio_counts_every_answer_sent_chunk_by_chunk(tokenizer, body, streamed):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 3
    assert (await c.post("/v1/audio/speech", json={"input": "hi there", **body})).status_code == 200
    text = (await c.get("/metrics")).text
    counts = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^vllm_omni:audio_(ttfp_s|underrun_s|duration_s)_count\{[^}]*\} (\S+)$", text, re.M)}
    assert counts == ({"ttfp_s": 1, "underrun_s": 1, "duration_s": 1} if streamed else {"duration_s": 1})


async def test_a_refused_speech_reads_the_engines_sentence_without_internal_ids(tokenizer, caplog):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.fail = StageFailed(1, "s1r0", "EngineError: request speech-0f3a: nothing to speak in text '—'", "client",
                            entry_rid="speech-0f3a")     # the orchestrator's word: speech's entry stage refused it
    with caplog.at_level("INFO"):
        err = assert_error(await c.post("/v1/audio/speech", json={"input": "—"}), 400)
    assert err["message"] == "nothing to speak in text '—'"     # before: "stage 1 replica s1r0: EngineError: ..."
    assert "stage 1 replica s1r0: EngineError: request speech-0f3a" in caplog.text    # the operator's log keeps it


def test_a_refusal_past_the_entry_stage_keeps_where_it_failed(caplog):
    """A later stage's input came from another stage (code2wav's codes from the talker), so its refusal, a bug's
    TypeError among them, is not the client's sentence: stage, replica and class stay, and a WARNING says so."""
    e = StageFailed(2, "s2r0", "TypeError: 'NoneType' object is not subscriptable", "client")
    with caplog.at_level("WARNING"):
        err = to_api_error(e)
    assert err.status == 400 and err.message == "stage 2 replica s2r0: TypeError: 'NoneType' object is not subscriptable"
    assert "past its entry stage" in caplog.text        # before: the bare sentence, and an INFO line only
    # at the entry stage only this request's id goes: another "request <word>: " is the engine's sentence
    e = StageFailed(0, "s0r0", "ValueError: request length: 3 > 2", "client", entry_rid="chatcmpl-1")
    assert to_api_error(e).message == "request length: 3 > 2"      # before: "3 > 2"
    e = StageFailed(0, "s0r0", "EngineError: request 'chatcmpl-1': the prompt is empty", "client", entry_rid="chatcmpl-1")
    assert to_api_error(e).message == "the prompt is empty"


async def test_speed_null_is_the_default(tokenizer):
    # vllm-omni's speed is `float | None = 1.0`: its clients may send null
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 1
    r = await c.post("/v1/audio/speech", json={"input": "hi", "speed": None})
    assert r.status_code == 200, r.text
    assert orch.requests[-1].speed == 1.0
