"""Issue 14: `omni serve DIR` of a tiny Qwen2.5-Omni (real architecture, seeded random weights) equals
transformers' `generate()`, greedy on thinker and talker, after `torch.manual_seed(0)` (the request's
`seed: 0` seeds token2wav's noise): the chat text exactly, the WAV to int16 rounding. vLLM runs the
thinker and hands the talker every fed token's last-layer row. Requests go through the `openai` client.

One server for the module (vLLM's start-up dominates).
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

from tests.e2e.harness import OmniProcess, answer, omni_env
from tests.unit.qwen25_ref import Reference, wave as ref_wave

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

pytestmark = [
    pytest.mark.e2e, pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (`pip install -e '.[vllm]'`)"),
]

THINKER_TOKENS = 10
TALKER_TOKENS = 40
SYSTEM = {"role": "system", "content": "You are helpful."}
NAME = "qwen25-omni-tiny"
# Greedy talker (the request's temperature drives the thinker); the request's seed drives token2wav.
# A float32 thinker: vLLM's dtype "auto" runs a float32 checkpoint in bfloat16, which flips near ties.
# The deploy's thinker repetition_penalty (1.1) reaches the thinker where a client sets none; the
# reference generates without one.
OVERRIDES = {"0": {"dtype": "float32", "default_sampling_params": {"repetition_penalty": 1.0}},
             "1": {"default_sampling_params": {"temperature": 0, "max_tokens": TALKER_TOKENS}}}


def env() -> dict:
    return omni_env(VLLM_HOST_IP="127.0.0.1", VLLM_CPU_CI_ENV="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                    OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omni.models.qwen25_omni.tiny import build

    return build(tmp_path_factory.mktemp("q25") / "any-folder-name")


@pytest.fixture(scope="module")
def server(tiny):
    p = OmniProcess("serve", str(tiny), "--port", "0", "--served-model-name", NAME,
                    "--stage-overrides", json.dumps(OVERRIDES), env=env())
    try:
        yield p.http(timeout=600)
    finally:
        p.interrupt()


@pytest.fixture(scope="module")
def reference(tiny):
    import torch

    torch.set_num_threads(1)
    ref = Reference(tiny)
    cache: dict = {}

    def run(text: str, speaker: str = "Chelsie", audio: bool = False):
        key = (text, speaker, audio)
        if key not in cache:
            r = ref.run(text, speaker=speaker, thinker_tokens=THINKER_TOKENS, talker_tokens=TALKER_TOKENS,
                        audio=audio, seed=0)
            cache[key] = (ref.tok.decode(r.generated, skip_special_tokens=True), r.wav.numpy(), len(r.codes))
        return cache[key]
    return run


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def int16(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, -1, 1) * 32767).round().astype(np.int16)


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


def chat(url: str, text: str, voice: str = "Chelsie", audio_in: bool = False, **kw):
    content = text
    if audio_in:
        b64 = base64.b64encode(float_wav(ref_wave(0))).decode()
        content = [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
                   {"type": "text", "text": text}]
    return client(url).chat.completions.create(
        model=NAME, messages=[SYSTEM, {"role": "user", "content": content}], max_tokens=THINKER_TOKENS,
        temperature=0, seed=0, modalities=["text", "audio"], audio={"voice": voice, "format": "wav"}, **kw)


def assert_same_audio(data: bytes, want_wav: np.ndarray) -> None:
    rate, got = wav_samples(data)
    assert rate == 24000
    want = int16(want_wav)
    assert got.shape == want.shape and want.size > 0
    assert np.abs(got.astype(int) - want).max() <= 1          # int16 rounding of the same waveform


def test_chat_with_audio_equals_generate(server, reference):
    want_text, want_wav, n_codes = reference("What is the capital of France?")
    assert n_codes > 5     # the talker spoke for a while: the rows of many thinker tokens were read
    m = answer(chat(server, "What is the capital of France?"))
    assert m.content == want_text and m.audio.transcript == want_text      # OpenAI's one choice
    assert_same_audio(base64.b64decode(m.audio.data), want_wav)


def test_text_only_chat_equals_generate_text(server, reference):
    want, _, _ = reference("What is the capital of France?")
    r = client(server).chat.completions.create(
        model=NAME, messages=[SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=THINKER_TOKENS, temperature=0, modalities=["text"])
    assert r.choices[0].message.content == want and r.choices[0].message.audio is None


def test_streamed_chat_audio_equals_generate(server, reference):
    want_text, want_wav, _ = reference("Tell me about the sea.", speaker="Ethan")
    stream = client(server).chat.completions.create(
        model=NAME, messages=[SYSTEM, {"role": "user", "content": "Tell me about the sea."}],
        max_tokens=THINKER_TOKENS, temperature=0, seed=0, modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"}, stream=True)
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
    got = np.frombuffer(bytes(pcm), "<i2")
    assert got.shape == want_wav.shape
    assert np.abs(got.astype(int) - int16(want_wav)).max() <= 1


def test_two_concurrent_requests_each_equal_their_reference(server, reference):
    cases = [("Where is the river?", "Chelsie"), ("Read me a short story.", "Ethan")]
    wants = [reference(q, v) for q, v in cases]
    results: list = [None, None]

    def go(i):
        results[i] = answer(chat(server, cases[i][0], voice=cases[i][1]))
    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for (want_text, want_wav, _), m in zip(wants, results):
        assert m is not None and m.content == want_text
        assert_same_audio(base64.b64decode(m.audio.data), want_wav)


def test_audio_input_reaches_the_thinker_and_the_talker(server, reference):
    want_text, want_wav, _ = reference("What do you hear?", audio=True)
    m = answer(chat(server, "What do you hear?", audio_in=True))
    assert m.content == want_text
    assert_same_audio(base64.b64decode(m.audio.data), want_wav)


def test_a_voice_the_model_lacks_is_404_naming_it(server):
    r = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "modalities": ["text", "audio"],
        "audio": {"voice": "aiden", "format": "wav"}})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["param"] == "audio.voice" and "chelsie" in r.json()["error"]["message"]
