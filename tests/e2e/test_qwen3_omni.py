"""Issue 13: `omni serve DIR` of a tiny Qwen3-Omni (real architecture, seeded random weights) equals
transformers' `generate(return_audio=True)`, greedy end to end: the chat text, and the WAV to int16
rounding (streamed: within 1e-3). Requests go through the official `openai` client.

One all-in-one server for most tests; the last test runs the head and two headless stages.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import wave

import httpx
import numpy as np
import pytest

from benchmarks import omni_chat_client as oc
from tests.e2e.harness import OmniProcess, answer, omni_env
from tests.unit.qwen3_ref import Reference, tone

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

pytestmark = [
    pytest.mark.e2e, pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (`pip install -e '.[vllm]'`)"),
]

THINKER_TOKENS = 12
TALKER_TOKENS = 30
SYSTEM = {"role": "system", "content": "You are helpful."}
# Greedy everywhere: the request's own temperature drives the thinker, the stage defaults the talker.
NAME = "qwen3-omni-tiny"
# A float32 thinker: vLLM's dtype "auto" runs a float32 checkpoint in bfloat16, which flips near ties.
OVERRIDES = {"0": {"dtype": "float32"},
             "1": {"default_sampling_params": {"temperature": 0, "max_tokens": TALKER_TOKENS}}}


def env() -> dict:
    return omni_env(VLLM_HOST_IP="127.0.0.1", VLLM_CPU_CI_ENV="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                    OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omni.models.qwen3_omni.tiny import build

    return build(tmp_path_factory.mktemp("q3") / "any-folder-name")


@pytest.fixture(scope="module")
def server(tiny):
    p = OmniProcess("serve", str(tiny), "--port", "0", "--served-model-name", NAME,
                    "--stage-overrides", json.dumps(OVERRIDES), env=env())
    try:
        url = p.http(timeout=600)
        yield url
    finally:
        p.interrupt()


@pytest.fixture(scope="module")
def reference(tiny):
    import torch

    torch.set_num_threads(1)
    ref = Reference(tiny)
    cache: dict = {}

    def run(text: str, speaker: str = "Ethan", audio: bool = False, talker_tokens: int = TALKER_TOKENS,
            thinker_tokens: int = THINKER_TOKENS):
        key = (text, speaker.lower(), audio, talker_tokens, thinker_tokens)
        if key not in cache:
            r = ref.run(text, speaker=speaker, thinker_tokens=thinker_tokens, talker_tokens=talker_tokens,
                        audio=audio)
            text_out = ref.tok.decode(r.generated, skip_special_tokens=True)
            cache[key] = (text_out, r.wav.numpy())
        return cache[key]
    return run


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def int16(wav: np.ndarray) -> np.ndarray:
    return (np.clip(wav, -1, 1) * 32767).round().astype(np.int16)


def wav_samples(data: bytes) -> tuple[int, np.ndarray]:
    w = wave.open(io.BytesIO(data))
    assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
    return w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")


def float_wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    """An IEEE-float WAV: the server decodes exactly these samples (no quantisation)."""
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt " +
            struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def chat(url: str, text: str, voice: str = "Ethan", audio_in: bool | str = False, **kw):
    content = text
    if audio_in:
        b64 = base64.b64encode(float_wav(tone(0))).decode()
        part = ({"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64}"}} if audio_in == "audio_url"
                else {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}})
        content = [part, {"type": "text", "text": text}]
    return client(url).chat.completions.create(
        model=NAME, messages=[SYSTEM, {"role": "user", "content": content}],
        max_tokens=THINKER_TOKENS, temperature=0, modalities=["text", "audio"],
        audio={"voice": voice, "format": "wav"}, **kw)


def test_text_only_chat_equals_the_reference_text(server, reference, tiny):
    want, want_wav = reference("What is the capital of France?")
    messages = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    r = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=THINKER_TOKENS,
                                               temperature=0, modalities=["text"])
    assert r.choices[0].message.content == want
    assert r.choices[0].message.audio is None
    # vllm-omni's default (its example clients name no modalities): every output the pipeline makes
    m = answer(client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=THINKER_TOKENS,
                                                      temperature=0))
    assert m.content == want
    _, got = wav_samples(base64.b64decode(m.audio.data))
    assert np.abs(got.astype(int) - int16(want_wav)).max() <= 1


def test_chat_with_audio_equals_the_reference_waveform(server, reference, tiny):
    want_text, want_wav = reference("What is the capital of France?")
    m = answer(chat(server, "What is the capital of France?"))
    assert m.content == want_text and m.audio.transcript == want_text      # OpenAI's one choice
    rate, got = wav_samples(base64.b64decode(m.audio.data))
    assert rate == 24000
    want = int16(want_wav)
    assert got.shape == want.shape
    assert np.abs(got.astype(int) - want).max() <= 1          # int16 rounding of the same waveform


def test_vllm_omnis_sampling_params_list_equals_the_reference(server, reference, tiny):
    """vllm-omni's per-stage sampling, in its example request's shape: the greedy thinker and talker come
    from the list (entry 0 in place of the request's own fields), the talker's stop id is its codec's end."""
    eos = json.loads((tiny / "config.json").read_text())["talker_config"]["codec_eos_token_id"]
    want_text, want_wav = reference("What is the capital of France?")
    stages = [{"temperature": 0.0, "max_tokens": THINKER_TOKENS, "detokenize": True},
              {"temperature": 0.0, "top_k": 50, "max_tokens": TALKER_TOKENS, "repetition_penalty": 1.05,
               "stop_token_ids": [eos], "detokenize": False},
              {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "repetition_penalty": 1.1}]
    m = answer(client(server).chat.completions.create(
        model=NAME, messages=[SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=2, temperature=1.5, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
        extra_body={"sampling_params_list": stages}))
    assert m.content == want_text
    _, got = wav_samples(base64.b64decode(m.audio.data))
    assert got.shape == int16(want_wav).shape and np.abs(got.astype(int) - int16(want_wav)).max() <= 1
    bad = dict(stages[1], stop_token_ids=[eos, 5])          # a code the talker never stops at
    r = httpx.post(server + "/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "modalities": ["text", "audio"],
        "sampling_params_list": [stages[0], bad]})
    assert r.status_code == 400 and f"stop_token_ids=[{eos}, 5]" in r.text, r.text   # before the thinker runs
    assert r.json()["error"]["param"] == "sampling_params_list[1].stop_token_ids", r.text


@pytest.mark.parametrize("modalities", [["text", "audio"], ["audio"]])
def test_a_talker_that_stops_first_still_gives_the_whole_answer(server, reference, tiny, modalities):
    """The talker's max_tokens (3) ends its codes while the thinker still writes (48 tokens): code2wav's
    input closes then, the thinker's pieces already on their way to the talker are dropped there, the
    thinker goes on for the text (or, with only audio asked for, is stopped); the answer is the
    reference's, text and audio."""
    eos = json.loads((tiny / "config.json").read_text())["talker_config"]["codec_eos_token_id"]
    want_text, want_wav = reference("Tell me about the sea.", talker_tokens=3, thinker_tokens=48)
    stages = [{"temperature": 0.0, "max_tokens": 48},
              {"temperature": 0.0, "top_k": 50, "max_tokens": 3, "repetition_penalty": 1.05, "stop_token_ids": [eos]}]
    r = client(server).chat.completions.create(
        model=NAME, messages=[SYSTEM, {"role": "user", "content": "Tell me about the sea."}], modalities=modalities,
        audio={"voice": "Ethan", "format": "wav"}, extra_body={"sampling_params_list": stages})
    m = answer(r)
    assert m.content == want_text if "text" in modalities else r.choices[0].message.content is None
    _, got = wav_samples(base64.b64decode(m.audio.data))
    assert got.shape == int16(want_wav).shape and np.abs(got.astype(int) - int16(want_wav)).max() <= 1


def test_streamed_chat_audio_is_within_1e_3_of_the_reference(server, reference):
    want_text, want_wav = reference("Tell me about the sea.", speaker="Chelsie")
    stream = client(server).chat.completions.create(
        model=NAME, messages=[SYSTEM, {"role": "user", "content": "Tell me about the sea."}],
        max_tokens=THINKER_TOKENS, temperature=0, modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "pcm16"}, stream=True)
    text, pcm, rates = "", bytearray(), set()
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        audio = getattr(delta, "audio", None)
        audio = audio.model_dump() if hasattr(audio, "model_dump") else audio
        if audio and audio.get("data"):
            pcm += base64.b64decode(audio["data"])
            rates.add(audio["sample_rate"])
    assert text == want_text and rates == {24000}
    got = np.frombuffer(bytes(pcm), "<i2").astype(np.float64) / 32767
    assert got.shape == want_wav.shape
    assert np.abs(got - np.clip(want_wav, -1, 1)).max() <= 1e-3


def audio_counts(url: str) -> tuple[float, float, float]:
    """vllm_omni:audio_ttfp_s_count, _duration_s_count and _duration_s_sum, over every label set."""
    out = {"vllm_omni:audio_ttfp_s_count": 0.0, "vllm_omni:audio_duration_s_count": 0.0,
           "vllm_omni:audio_duration_s_sum": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return tuple(out.values())


def test_vllm_omni_client_reads_the_stream_and_the_metrics_count_it(server, reference):
    """vllm-omni's benchmark client (its request and its parse: benchmarks/omni_chat_client.py) gets
    the reference audio from WAV chunks; /metrics counts the first audio once and the seconds."""
    import asyncio

    want_text, want_wav = reference("Tell me about the sea.")          # the default voice: Ethan
    body = oc.payload(NAME, "", THINKER_TOKENS, {"modalities": ["text", "audio"]})
    body["messages"] = [SYSTEM, {"role": "user", "content": "Tell me about the sea."}]
    before = audio_counts(server)

    async def go():
        async with httpx.AsyncClient(timeout=300) as c:
            return await oc.chat(c, f"{server}/v1/chat/completions", body)
    got = asyncio.run(go())
    after = audio_counts(server)
    assert got.ok and got.dropped_chunks == 0 and got.sample_rate == 24000, got.error
    assert got.text == want_text
    pcm = np.frombuffer(got.pcm, "<i2").astype(np.float64) / 32767
    assert pcm.shape == want_wav.shape and np.abs(pcm - np.clip(want_wav, -1, 1)).max() <= 1e-3
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    assert after[2] - before[2] == pytest.approx(len(want_wav) / 24000, abs=1e-6)
    assert got.usage["audio_duration_s"] == pytest.approx(len(want_wav) / 24000, abs=1e-6)
    assert 0 < got.usage["audio_ttfp_s"] and 0 < got.audio_ttfp <= got.audio_generate_time


def test_two_concurrent_requests_each_equal_their_reference(server, reference):
    cases = [("Where is the river?", "Aiden"), ("Read me a short story.", "Ethan")]
    wants = [reference(q, v) for q, v in cases]
    results: list = [None, None]

    def go(i):
        results[i] = answer(chat(server, cases[i][0], voice=cases[i][1]))
    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for (want_text, want_wav), m in zip(wants, results):
        assert m is not None and m.content == want_text
        _, got = wav_samples(base64.b64decode(m.audio.data))
        assert np.abs(got.astype(int) - int16(want_wav)).max() <= 1


@pytest.mark.parametrize("part", ["input_audio", "audio_url"])
def test_audio_input_reaches_the_thinker_and_the_talker(server, reference, part):
    """OpenAI's input_audio part, and vLLM's audio_url with a data URL (vllm-omni's example clients)."""
    want_text, want_wav = reference("What do you hear?", audio=True)
    m = answer(chat(server, "What do you hear?", audio_in=part))
    assert m.content == want_text
    _, got = wav_samples(base64.b64decode(m.audio.data))
    assert np.abs(got.astype(int) - int16(want_wav)).max() <= 1


@pytest.mark.parametrize("body, param", [
    ({"audio": {"voice": "joe", "format": "wav"}}, "audio.voice"),
    ({"audio": {"voice": "ethan", "format": "ogg"}}, "audio.format"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"not a wav").decode(), "format": "wav"}}]}]},
     "messages[0].content[0].input_audio.data"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}]}]},
     "messages[0].content[0].input_audio.data"),
    ({"messages": [{"role": "user", "content": [
        {"type": "audio_url", "audio_url": {"url": "https://example.com/mary_had_lamb.ogg"}}]}]},
     "messages[0].content[0].audio_url.url"),
    ({"messages": [{"role": "user", "content": [
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,%%%"}}]}]},
     "messages[0].content[0].audio_url.url"),
])
def test_bad_audio_requests_are_4xx_naming_the_parameter(server, body, param):
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "modalities": ["text", "audio"],
           "audio": {"voice": "ethan", "format": "wav"}, **body}
    r = httpx.post(server + "/v1/chat/completions", json=req, timeout=60)
    assert r.status_code == (404 if param == "audio.voice" else 400), r.text   # an unknown voice: 404
    assert r.json()["error"]["param"] == param


def test_speech_route_says_why_it_is_not_there(server):
    r = httpx.post(server + "/v1/audio/speech", json={"input": "hello", "voice": "ethan"}, timeout=60)
    assert r.status_code == 400 and "modalities" in r.json()["error"]["message"]


def test_head_and_headless_stages_equal_the_reference(tiny, reference, tmp_path):
    want_text, want_wav = reference("What is the capital of France?")
    # Stage mode takes no --stage-overrides: every process reads one deploy file with a greedy talker,
    # written in vllm-omni's deploy schema as its users pass it to each stage's command (no engines: it
    # overlays the folder's bundled pipeline; the connector's codec keys at code2wav's defaults).
    deploy = tmp_path / "greedy.yaml"
    deploy.write_text(f"""
async_chunk: true
dtype: float32
connectors:
  shm: {{name: SharedMemoryConnector, extra: {{codec_chunk_frames: 25, codec_left_context_frames: 25}}}}
stages:
  - stage_id: 1
    input_connectors: {{from_stage_0: shm}}
    default_sampling_params: {{temperature: 0, max_tokens: {TALKER_TOKENS}}}
  - stage_id: 2
    input_connectors: {{from_stage_1: shm}}
""")
    common = ("--deploy-config", str(deploy))
    head = OmniProcess("serve", str(tiny), *common, "--stage-id", "0", "--omni-master-address", "127.0.0.1",
                       "--omni-master-port", "0", "--port", "0", "--served-model-name", NAME, env=env())
    others: list[OmniProcess] = []
    try:
        master = head.master_address()
        host, port = master.rsplit(":", 1)
        for k in (1, 2):
            others.append(OmniProcess("serve", str(tiny), *common, "--stage-id", str(k), "--headless",
                                      "--omni-master-address", host, "--omni-master-port", port, env=env()))
        url = head.http(timeout=600)
        m = answer(client(url).chat.completions.create(
            model=NAME, messages=[SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
            max_tokens=THINKER_TOKENS, temperature=0, modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"}))
        assert m.content == want_text
        _, got = wav_samples(base64.b64decode(m.audio.data))
        assert np.abs(got.astype(int) - int16(want_wav)).max() <= 1
    finally:
        for p in others + [head]:
            p.interrupt()
