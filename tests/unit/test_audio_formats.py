"""Compressed audio out: speech's response_format and chat's audio.format mp3, flac, opus (Ogg) and aac (ADTS),
whole and streamed, decoded back with PyAV (omni/audio_encode.py; the routes against the fake orchestrator)."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import av
import numpy as np
import pytest

from omni.api.jobs import Jobs, LocalKv, Results
from omni.audio_encode import FORMATS, Encoder, encode
from tests.unit.api_fakes import assert_error, chat_body, make, tokenizer  # noqa: F401 (fixture)
from tests.unit.test_jobs import settle
from tests.unit.test_speech_compat import events as sse_events

pytestmark = pytest.mark.anyio
CONTENT_TYPES = {"mp3": "audio/mpeg", "flac": "audio/flac", "opus": "audio/ogg", "aac": "audio/aac"}
# A decoder reads what the encoder padded to whole frames, and (no header says the encoder's delay) a stream's
# mp3 and any ADTS file its priming: at most two frames (mp3 1152, aac 1024, Opus 960 at 48 kHz, FLAC 4608).
SLACK = {"mp3": 2 * 1152, "aac": 2 * 1024, "opus": 2 * 960, "flac": 0}
CHUNKS = 100          # the fake's audio: CHUNKS x 100 samples at 22050 Hz, a +-0.5 square wave


def decoded(data: bytes) -> tuple[np.ndarray, int]:
    """The file's samples (float, mono) and rate."""
    with av.open(io.BytesIO(data)) as box:
        frames = list(box.decode(audio=0))
    rate = frames[0].sample_rate
    samples = np.concatenate([f.to_ndarray().reshape(-1).astype(np.float64) for f in frames])
    if frames[0].format.name.startswith("s16"):
        samples /= 32768.0
    return samples, rate


def assert_sound(data: bytes, fmt: str, n_in: int, rate_in: int = 22050) -> int:
    """`data` decodes to the input's length (within the codec's frames) and is not silence; its rate."""
    samples, rate = decoded(data)
    expected = n_in * rate / rate_in
    assert expected - 1 <= samples.size <= expected + SLACK[fmt], (fmt, samples.size, expected)
    assert np.sqrt(np.mean(samples ** 2)) > 0.2, fmt     # the input's RMS is 0.5 (sine) or 0.5 (square)
    return rate


@pytest.mark.parametrize("rate", [22050, 24000])   # Piper's and Qwen3-Omni's
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_whole_file_and_a_stream_decode_to_the_samples(fmt, rate):
    x = (0.7 * np.sin(2 * np.pi * 440 * np.arange(2 * rate) / rate)).astype(np.float32)
    data, out_rate = encode(fmt, x.tobytes(), rate)
    assert out_rate == (24000 if fmt == "opus" else rate)     # Opus takes no 22050 Hz
    assert assert_sound(data, fmt, x.size, rate) == (48000 if fmt == "opus" else rate)   # Opus decodes at 48 kHz
    enc = Encoder(fmt, rate)
    parts = [enc.write(x[i:i + rate // 10]) for i in range(0, x.size, rate // 10)] + [enc.close()]
    assert sum(1 for p in parts[:-1] if p) >= len(parts) // 2, "a stream's bytes leave as they are made"
    assert_sound(b"".join(parts), fmt, x.size, rate)
    if fmt in ("mp3", "flac"):     # the whole file's headers say its length: exact
        assert decoded(data)[0].size == x.size


@pytest.mark.parametrize("fmt", sorted(FORMATS))
async def test_speech_answers_each_format_whole_and_streamed(tokenizer, fmt):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = CHUNKS
    body = {"input": "hi there", "voice": "joe", "response_format": fmt}
    r = await c.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPES[fmt], r.text
    assert r.headers["x-sample-rate"] == ("24000" if fmt == "opus" else "22050")
    assert_sound(r.content, fmt, CHUNKS * 100)
    raw = await c.post("/v1/audio/speech", json={**body, "stream_format": "audio"})
    assert raw.status_code == 200 and raw.headers["content-type"] == CONTENT_TYPES[fmt], raw.text
    assert_sound(raw.content, fmt, CHUNKS * 100)
    evs = sse_events((await c.post("/v1/audio/speech", json={**body, "stream": True})).text)
    assert [e["type"] for e in evs][-1] == "speech.audio.done"
    deltas = [base64.b64decode(e["audio"]) for e in evs if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and all(deltas)
    assert_sound(b"".join(deltas), fmt, CHUNKS * 100)


async def test_speech_refuses_an_unknown_format_naming_the_field_and_the_choices(tokenizer):
    _, c = make(tokenizer, speech_entry_stage=1)
    for fmt in ("ogg", "MP3", ""):
        err = assert_error(await c.post("/v1/audio/speech", json={"input": "hi", "response_format": fmt}), 400,
                           "response_format")
        assert "wav, pcm, mp3, flac, opus, aac" in err["message"], err
    assert_error(await c.post("/v1/audio/speech", json={"input": "hi", "response_format": "x" * 100}), 400,
                 "response_format")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
async def test_chat_answers_each_audio_format_whole_and_refuses_it_streamed(tokenizer, fmt):
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = CHUNKS
    body = chat_body(modalities=["text", "audio"], audio={"voice": "joe", "format": fmt})
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    audio = r.json()["choices"][0]["message"]["audio"]
    assert audio["format"] == fmt and audio["transcript"] == "hello world"
    assert_sound(base64.b64decode(audio["data"]), fmt, CHUNKS * 100)
    err = assert_error(await c.post("/v1/chat/completions", json={**body, "stream": True}), 400, "audio.format")
    assert "stream" in err["message"] and "pcm16" in err["message"]
    err = assert_error(await c.post("/v1/chat/completions", json={**body, "audio": {"format": "ogg"}}), 400,
                       "audio.format")
    assert "wav, pcm16, mp3, flac, opus, aac" in err["message"]


async def test_a_speech_job_keeps_the_format_and_its_content_type(tokenizer, tmp_path):
    jobs = Jobs(LocalKv(), Results(tmp_path), frontend_index=0, host="h0")
    orch, c = make(tokenizer, speech_entry_stage=1, jobs=jobs)
    orch.audio_chunks = CHUNKS
    r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/audio/speech",
                                            "body": {"input": "hi", "response_format": "mp3"}})
    assert r.status_code == 200, r.text
    await settle(jobs)
    content = await c.get(f"/v1/omni/jobs/{r.json()['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "audio/mpeg"
    assert_sound(content.content, "mp3", CHUNKS * 100)


async def test_the_served_schema_lists_the_formats_and_their_content_types(tokenizer):
    _, c = make(tokenizer, speech_entry_stage=1)
    schemas = (await c.get("/openapi.json")).json()["components"]["schemas"]
    assert schemas["SpeechRequest"]["properties"]["response_format"]["enum"] == \
        ["wav", "pcm", "mp3", "flac", "opus", "aac"]
    assert schemas["AudioOptions"]["properties"]["format"]["enum"] == ["wav", "pcm16", "mp3", "flac", "opus", "aac"]
    paths = (await c.get("/openapi.json")).json()["paths"]
    for path, method in (("/v1/audio/speech", "post"), ("/v1/omni/jobs/{job_id}/content", "get")):
        assert set(CONTENT_TYPES.values()) <= set(paths[path][method]["responses"]["200"]["content"]), path



def test_a_close_waits_for_a_write_on_another_thread_and_later_writes_are_refused():
    """A stream cancelled while its write runs on a thread closes the encoder after that write, never inside it."""
    import threading

    enc = Encoder("mp3", 24000)
    x = np.full(24000 * 5, 0.3, np.float32)
    outcome = []

    def write():
        try:
            outcome.append(enc.write(x))
        except ValueError as e:      # the close came first
            outcome.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    enc.close()
    writer.join(10)
    assert not writer.is_alive() and len(outcome) == 1 and enc.close() == b""
    with pytest.raises(ValueError, match="closed"):
        enc.write(x)


async def test_the_openai_clients_speech_create_gets_each_format(tokenizer):
    """The newcomer's call: client.audio.speech.create(response_format="mp3") was a 400 (Invalid enum value)."""
    import httpx
    from openai import AsyncOpenAI

    from omni.api import build_app
    from tests.unit.api_fakes import FakeOrchestrator

    orch = FakeOrchestrator(tokenizer)
    orch.audio_chunks = CHUNKS
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, speech_entry_stage=1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1") as http:
        client = AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http)
        for fmt in sorted(FORMATS):
            r = await client.audio.speech.create(model="tiny", voice="joe", input="hi there", response_format=fmt)
            assert_sound(r.content, fmt, CHUNKS * 100)


@pytest.mark.parametrize("rate", [22050, 44100, 96000])
@pytest.mark.parametrize("n", [1, 2, 20])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_few_samples_make_a_file_that_decodes(fmt, n, rate):
    # Opus through the resampler and mp3 above 48 kHz made 0 bytes for up to 20 samples, AAC of 1-2 an
    # undecodable file; a few samples are padded with silence to one short file
    data, _ = encode(fmt, np.full(n, 0.5, np.float32), rate)
    samples, _ = decoded(data)
    assert samples.size >= n


def test_an_encoder_dropped_unclosed_does_not_take_the_process_down():
    # Collected with its file and its container open, a written encoder crashed Python (SIGSEGV or abort
    # inside FFmpeg's write callback); each runs in a child, as the crash would take pytest with it.
    script = ("import gc, numpy as np\nfrom omni.audio_encode import Encoder, FORMATS\n"
              "for _ in range(20):\n    for f in sorted(FORMATS):\n"
              "        e = Encoder(f, 22050); e.write(np.zeros(24000, np.float32)); del e; gc.collect()\n"
              "print('alive')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "alive"), done.stderr[-2000:]
