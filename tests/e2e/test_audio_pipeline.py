"""Issue 6: the speech pipeline (thinker -> talker -> code2wav) served by `omni serve`,
checked over HTTP: WAV/PCM speech, determinism, chat with audio (whole and streamed),
streamed audio joining to the one-shot waveform, and voices. Issue 27: the audio metrics move
as the requests say, and vllm-omni's benchmark client reads the streamed chat audio."""

from __future__ import annotations

import base64
import io
import json
import os
import queue
import re
import signal
import threading
import time
import uuid
import wave

import httpx
import numpy as np
import pytest

from benchmarks import omni_chat_client as oc
from tests.e2e.harness import OmniProcess, descendants, omni_shm_entries, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RATE = 22050
# The greedy thinker answers this with two sentences, so the talker gets two sub-requests.
CATS = [{"role": "user", "content": "Tell me about cats in three sentences."}]
TEXTS = [
    "Hi there.",
    "The quick brown fox jumps over the lazy dog.",
    "A stage runtime moves tensors between processes. It keeps every stage busy, "
    "and it streams the audio while the text is still being written.",
]


@pytest.fixture(scope="module")
def server():
    p = OmniProcess("serve", MODEL, "--port", "0")
    try:
        p.http(300)
        yield p
    finally:
        assert omni_shm_entries(p.stop(60)) == []   # Ctrl-C, the whole tree gone, its shm with it


@pytest.fixture(scope="module")
def url(server):
    return server.http(1)


def speech(url: str, text: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/speech", timeout=120,
                      json={"model": MODEL, "input": text, "voice": "joe", **body})


def wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        frames = w.readframes(w.getnframes())
    assert len(frames) == 2 * w.getnframes()
    return np.frombuffer(frames, dtype="<i2")


def seconds(samples: np.ndarray) -> float:
    return len(samples) / RATE


def sentences(text: str) -> int:
    return len(re.findall(r"[.!?](\s|$)", text))


# ---------------------------------------------------------------- /v1/audio/speech


@pytest.fixture(scope="module")
def speech_wavs(url):
    out = []
    for text in TEXTS:
        r = speech(url, text, response_format="wav")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("audio/wav")
        out.append(r.content)
    return out


def test_speech_is_a_22khz_wav_whose_length_follows_the_text(speech_wavs):
    durations = [seconds(wav_samples(w)) for w in speech_wavs]
    for text, d in zip(TEXTS, durations):
        # English speech runs at roughly 10-20 characters a second.
        assert len(text) / 30 < d < len(text) / 6 + 0.5, (text, d)
    assert durations == sorted(durations) and durations[0] < durations[-1] / 3
    for w in speech_wavs:
        s = wav_samples(w).astype(np.float32) / 32767
        assert 0.01 < float(np.sqrt(np.mean(s ** 2))) < 0.7   # neither silence nor clipping noise


def test_speech_is_deterministic_and_pcm_matches_the_wav(url, speech_wavs):
    again = speech(url, TEXTS[1], response_format="wav")
    assert again.status_code == 200
    assert again.content == speech_wavs[1]   # noise scales are 0 in the deploy config
    pcm = speech(url, TEXTS[1], response_format="pcm")
    assert pcm.status_code == 200, pcm.text
    assert pcm.headers["content-type"].startswith("audio/pcm")
    assert pcm.headers["x-sample-rate"] == str(RATE)
    assert pcm.content == wav_samples(speech_wavs[1]).tobytes()


def test_pcm_speech_streams_while_the_request_is_still_running(url, speech_wavs):
    import re

    body = {"model": MODEL, "input": " ".join(TEXTS), "response_format": "pcm"}
    got = bytearray()
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()
        got += next(chunks)
        # The first bytes are here and the pipeline still holds the request: it streams.
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        in_flight = re.search(r"^omni_frontend_in_flight\{[^}]*\} (\d+)", metrics, re.M)
        assert in_flight and int(in_flight.group(1)) == 1, metrics
        for chunk in chunks:
            got += chunk
    whole = speech(url, " ".join(TEXTS), response_format="pcm")
    assert bytes(got) == whole.content and len(got) > 2 * RATE


def test_speed_shortens_the_audio(url, speech_wavs):
    r = speech(url, TEXTS[2], speed=2.0)
    assert r.status_code == 200, r.text
    ratio = seconds(wav_samples(r.content)) / seconds(wav_samples(speech_wavs[2]))
    assert 0.35 < ratio < 0.7, ratio


def test_served_speech_equals_an_in_process_one_shot_decode(speech_wavs):
    """code2wav decodes in chunks with context on both sides; joined, they match one decode."""
    import torch

    from omni.engines.base import EngineRequest, SamplingOverrides
    from omni.models.piper.engines import Code2WavEngine, TalkerEngine
    from omni.models.piper.voice import prepare_voice

    torch.set_num_threads(1)
    voice = prepare_voice("joe")
    talker = TalkerEngine(voice)
    talker.add_request(EngineRequest(request_id="ref", text=TEXTS[2],
                                     overrides=SamplingOverrides(noise_scale=0.0, noise_w_scale=0.0)))
    pieces = []
    while talker.has_unfinished():
        pieces += talker.step()
    assert len(pieces) == 2   # two sentences: the stream crosses a sentence boundary
    one_shot = Code2WavEngine(voice, chunk_frames=10**9)
    one_shot.add_request(EngineRequest(request_id="ref", tensors={
        "latents": torch.cat([p.tensors["latents"] for p in pieces], dim=2)}))
    ref = np.concatenate([o.tensors["audio"].numpy() for o in one_shot.step()])
    ref16 = (np.clip(ref, -1, 1) * 32767).round().astype(np.int32)
    served = wav_samples(speech_wavs[2]).astype(np.int32)
    assert len(served) == len(ref16)
    diff = np.abs(served - ref16)
    assert diff.max() <= 0.01 * 32767, diff.max()     # within 1% of full scale anywhere
    assert diff.mean() <= 0.001 * 32767, diff.mean()


# ---------------------------------------------------------------- chat with audio


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": CATS, "max_tokens": 64, "temperature": 0,
            "modalities": ["text", "audio"], "audio": {"voice": "joe", "format": "wav"}, **extra}


def vllm_omni_body(**extra) -> dict:
    """As vllm-omni's clients send it: no `audio` object (the default voice), so a text choice and an audio one."""
    return {k: v for k, v in chat_body(**extra).items() if k != "audio"}


@pytest.fixture(scope="module")
def chat_full(url):
    r = httpx.post(f"{url}/v1/chat/completions", json=vllm_omni_body(), timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def chat_stream(url):
    """The SSE events of the same request, streamed, in arrival order."""
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(stream=True), timeout=180) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append(("done", None))
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("content"):
                    events.append(("text", delta["content"]))
                audio = delta.get("audio")
                if audio and "data" in audio:
                    assert audio["format"] == "pcm16" and audio["sample_rate"] == RATE
                    events.append(("audio", base64.b64decode(audio["data"])))
                elif audio:
                    events.append(("audio_end", audio))
                if choice["finish_reason"]:
                    events.append(("finish", choice["finish_reason"]))
    return events


def test_chat_with_audio_returns_text_and_a_wav(chat_full):
    text_choice, audio_choice = chat_full["choices"]     # vllm-omni's shape: the audio in a choice of its own
    text = text_choice["message"]["content"]
    assert sentences(text) >= 2, text   # several talker sub-requests
    audio = audio_choice["message"]["audio"]
    assert audio["format"] == "wav" and audio["transcript"] == "" and audio["id"]
    assert audio_choice["message"]["content"] is None and audio_choice["finish_reason"] == "stop"
    d = seconds(wav_samples(base64.b64decode(audio["data"])))
    assert len(text) / 30 < d < len(text) / 6 + 0.5, (text, d)
    assert chat_full["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_cuts_the_text_and_the_audio_goes_on(url, chat_full):
    text = chat_full["choices"][0]["message"]["content"]
    second = text[re.search(r"[.!?]\s+", text).end():]
    stop = second[:8]                  # inside the second sentence
    r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(stop=[stop]), timeout=180)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]          # OpenAI's shape (an `audio` object): the text is the transcript
    cut = text[:text.index(stop)]
    assert choice["message"]["audio"]["transcript"] == cut and choice["message"]["content"] is None
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    # The first sentence at least is spoken (and what the thinker sent before the stop was seen).
    d = seconds(wav_samples(base64.b64decode(choice["message"]["audio"]["data"])))
    assert len(cut) / 30 < d, (cut, d)
    assert r.json()["usage"]["audio_duration_s"] > 0


def test_an_audio_only_chat_counts_its_text_and_carries_it_as_the_transcript(url, chat_full):
    r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(modalities=["audio"]), timeout=180)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    msg = choice["message"]
    assert msg["audio"]["transcript"] == chat_full["choices"][0]["message"]["content"] and msg["content"] is None
    assert r.json()["usage"]["completion_tokens"] == chat_full["usage"]["completion_tokens"]


def test_streamed_audio_starts_before_the_text_ends(chat_stream):
    kinds = [k for k, _ in chat_stream]
    assert kinds[-1] == "done" and "finish" in kinds
    first_audio = kinds.index("audio")
    last_text = len(kinds) - 1 - kinds[::-1].index("text")
    # Speech of the first sentence streams while the thinker still writes the second.
    assert first_audio < last_text, kinds
    assert kinds.count("audio") >= 3   # chunked, not one blob
    assert kinds.index("audio_end") > len(kinds) - 1 - kinds[::-1].index("audio")


def test_streamed_reply_joins_to_the_non_streaming_one(chat_full, chat_stream):
    msg = chat_full["choices"][1]["message"]
    text = "".join(v for k, v in chat_stream if k == "text")
    assert text == chat_full["choices"][0]["message"]["content"]
    end = next(v for k, v in chat_stream if k == "audio_end")
    assert end["transcript"] == text
    streamed = np.frombuffer(b"".join(v for k, v in chat_stream if k == "audio"), dtype="<i2")
    whole = wav_samples(base64.b64decode(msg["audio"]["data"]))
    assert len(streamed) == len(whole)
    diff = np.abs(streamed.astype(np.int32) - whole.astype(np.int32))
    assert diff.max() <= 0.01 * 32767, diff.max()


def test_text_only_chat_has_no_audio(url):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": CATS, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] and "audio" not in msg


# ---------------------------------------------------------------- voices and errors


def test_voice_presets_list_use_delete(url, speech_wavs):
    listed = httpx.get(f"{url}/v1/audio/voices", timeout=30)
    assert listed.status_code == 200
    assert "joe" in [v["name"] for v in listed.json()["data"]]
    name = f"quick-{uuid.uuid4().hex[:8]}"
    r = httpx.post(f"{url}/v1/audio/voices", json={"name": name, "base": "joe", "speed": 2.0}, timeout=30)
    assert r.status_code == 201, r.text
    assert name in [v["name"] for v in httpx.get(f"{url}/v1/audio/voices").json()["data"]]
    fast = speech(url, TEXTS[2], voice=name)
    assert fast.status_code == 200, fast.text
    ratio = seconds(wav_samples(fast.content)) / seconds(wav_samples(speech_wavs[2]))
    assert 0.35 < ratio < 0.7, ratio   # the preset's speed applies
    d = httpx.delete(f"{url}/v1/audio/voices/{name}", timeout=30)
    assert d.status_code == 200, d.text
    assert name not in [v["name"] for v in httpx.get(f"{url}/v1/audio/voices").json()["data"]]
    gone = speech(url, "Hello.", voice=name)
    assert 400 <= gone.status_code < 500 and name in gone.json()["error"]["message"]
    again = httpx.delete(f"{url}/v1/audio/voices/{name}", timeout=30)
    assert again.status_code == 404, again.text


@pytest.mark.parametrize("body, status, needle", [
    ({"input": "Hello.", "voice": "nobody-by-this-name"}, 404, "nobody-by-this-name"),
    ({"input": ""}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": "Hello.", "response_format": "ogg"}, 400, "ogg"),
    ({"input": "Hello.", "speed": 100}, 400, "speed"),
])
def test_bad_speech_requests_are_4xx_naming_the_problem(url, body, status, needle):
    r = httpx.post(f"{url}/v1/audio/speech", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_chat_audio_with_unknown_voice_is_a_4xx(url):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json=chat_body(audio={"voice": "nobody-by-this-name", "format": "wav"}))
    assert 400 <= r.status_code < 500 and "nobody-by-this-name" in r.json()["error"]["message"]


@pytest.mark.parametrize("text", ["...", "?! - ;", "hi\u0000there"])
def test_speech_of_nothing_speakable_is_a_client_error(url, text):
    r = speech(url, text)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input" or "speak" in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------- audio metrics (issue 27)


def scrape(url: str, name: str, **labels: str) -> float:
    return value(httpx.get(f"{url}/metrics", timeout=30).text, name, **labels)


def value(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


AUDIO = ("vllm_omni:audio_ttfp_s_count", "vllm_omni:audio_duration_s_count", "vllm_omni:audio_duration_s_sum",
         "omni_audio_underruns_total", "vllm_omni:audio_underrun_s_count", "vllm_omni:audio_underrun_s_sum")


def audio_figures(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {k: value(text, k, voice="joe") for k in AUDIO}


def stream_pcm16(url: str, body: dict) -> tuple[bytes, dict]:
    """Today's parse of a streamed chat: the joined pcm16 `delta.audio.data`, and the usage chunk."""
    pcm, usage = bytearray(), {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    data = (c["delta"].get("audio") or {}).get("data")
                    if data:
                        pcm += base64.b64decode(data)
    return bytes(pcm), usage


async def vllm_omni_chat(url: str, body: dict) -> oc.Result:
    async with httpx.AsyncClient(timeout=180) as client:
        return await oc.chat(client, f"{url}/v1/chat/completions", body)


def test_audio_metrics_count_each_request_and_its_seconds(url):
    import asyncio

    before = audio_figures(url)
    pcm, usage = stream_pcm16(url, chat_body(stream=True, audio={"voice": "joe", "format": "pcm16"},
                                             stream_options={"include_usage": True}))
    # vllm-omni's benchmark client: no `audio` object, so WAV chunks, each decoded alone.
    body = oc.payload(MODEL, CATS[0]["content"], 64, {"modalities": ["text", "audio"]})
    got = asyncio.run(vllm_omni_chat(url, body))
    whole = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), timeout=180).json()
    wav = wav_samples(base64.b64decode(whole["choices"][0]["message"]["audio"]["data"]))   # OpenAI's one choice
    after = audio_figures(url)
    delta = {k: after[k] - before[k] for k in AUDIO}
    # First audio once per streamed request (the whole one has none), seconds once per request.
    assert delta["vllm_omni:audio_ttfp_s_count"] == 2 and delta["vllm_omni:audio_duration_s_count"] == 3
    streamed_s, wav_s = len(pcm) / 2 / RATE, seconds(wav)
    assert got.ok and got.dropped_chunks == 0 and got.sample_rate == RATE, got.error
    assert delta["vllm_omni:audio_duration_s_sum"] == pytest.approx(streamed_s + got.audio_duration + wav_s, abs=1e-6)
    assert whole["usage"]["audio_duration_s"] == pytest.approx(wav_s, abs=1e-6)
    assert usage["audio_duration_s"] == pytest.approx(streamed_s, abs=1e-6)
    assert 0 < usage["audio_ttfp_s"] and 0 < whole["usage"]["audio_ttfp_s"]
    # The vllm-omni parse of the WAV chunks and today's parse of the pcm16 chunks: the same audio
    # (two requests: code2wav's chunk boundaries may differ, as between streamed and whole above).
    a, b = np.frombuffer(pcm, dtype="<i2"), np.frombuffer(got.pcm, dtype="<i2")
    assert len(a) == len(b) == len(wav) and got.text == whole["choices"][0]["message"]["audio"]["transcript"]
    assert np.abs(a.astype(np.int32) - b.astype(np.int32)).max() <= 0.01 * 32767
    assert 0 < got.audio_ttfp < got.latency and got.audio_rtf > 0
    # The speech stages' own step figures reach /metrics through their load reports (~1 s behind).
    for stage in ("1", "2"):
        wait_until(lambda s=stage: scrape(url, "omni_stage_engine_batch_size_count", stage=s) > 0, 15,
                   f"stage {stage} step figures in /metrics", every_s=0.25)
        text = httpx.get(f"{url}/metrics", timeout=30).text
        steps = value(text, "omni_stage_engine_step_seconds_count", stage=stage)
        assert steps == value(text, "omni_stage_engine_batch_size_count", stage=stage)
        assert value(text, "omni_stage_engine_batch_size_sum", stage=stage) >= steps    # at least one each
        assert value(text, "omni_stage_engine_step_seconds_sum", stage=stage) > 0


def stage_pid(launcher_pid: int, stage_id: int) -> int:
    import psutil

    for pid in descendants(launcher_pid):
        try:
            argv = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        if "omni.children" in argv and "stage" in argv and argv[argv.index("--stage-id") + 1] == str(stage_id):
            return pid
    raise AssertionError(f"no stage {stage_id} process under {launcher_pid}")


STARVE_MARGIN_S = 0.4


def test_a_stream_that_starves_counts_an_underrun(server, url):
    """code2wav is stopped (SIGSTOP) once the first audio is in; the client plays what it got and,
    once that has played out and STARVE_MARGIN_S more has passed with nothing new, code2wav goes
    on. The frontend hands the next chunk out after the client's player ran dry (its clock starts
    no later than the client's), so it counts an underrun. The stop stays well under the lease."""
    text = "Hi. " + " ".join(TEXTS[1:])
    before = audio_figures(url)
    code2wav = stage_pid(server.proc.pid, 2)
    chunks: queue.Queue = queue.Queue()

    def read() -> None:
        body = {"model": MODEL, "input": text, "voice": "joe", "response_format": "pcm"}
        try:
            with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=120) as r:
                for b in r.iter_raw():
                    chunks.put((time.monotonic(), b))
        finally:
            chunks.put(None)

    threading.Thread(target=read, daemon=True).start()
    first = chunks.get(timeout=120)
    assert first is not None, "the stream ended before any audio"
    os.kill(code2wav, signal.SIGSTOP)
    stopped = time.monotonic()
    got = [first[1]]
    try:
        play_end = first[0] + len(first[1]) / 2 / RATE
        while (left := play_end + STARVE_MARGIN_S - time.monotonic()) > 0:
            try:
                item = chunks.get(timeout=left)
            except queue.Empty:
                break
            assert item is not None, "all the audio came before code2wav was stopped: nothing to starve"
            play_end = max(play_end, item[0]) + len(item[1]) / 2 / RATE
            got.append(item[1])
        assert time.monotonic() - stopped < 3.0, "the audio sent before the stop lasts too long for the lease"
    finally:
        os.kill(code2wav, signal.SIGCONT)
    while (item := chunks.get(timeout=120)) is not None:
        got.append(item[1])
    after = audio_figures(url)
    assert after["omni_audio_underruns_total"] - before["omni_audio_underruns_total"] >= 1
    assert after["vllm_omni:audio_underrun_s_count"] - before["vllm_omni:audio_underrun_s_count"] == 1
    assert after["vllm_omni:audio_underrun_s_sum"] - before["vllm_omni:audio_underrun_s_sum"] >= STARVE_MARGIN_S
    # Stopping a stage does not change what it says.
    assert b"".join(got) == speech(url, text, response_format="pcm").content
