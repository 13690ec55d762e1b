"""Review fixes of the text routes: message counts, `model: ""`, vLLM's request fields, seeds,
audio formats (the frontend against test_api's fake orchestrator and tiny tokenizer)."""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import pytest

from omni.api import build_app
from tests.unit.test_api import FakeOrchestrator, assert_error, chat_body, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def client(tokenizer, **kw):
    orch = FakeOrchestrator(tokenizer, kw.pop("reply", "hello world"))
    kw.setdefault("served_model_name", "tiny")
    kw.setdefault("max_model_len", 128)
    app = build_app(orch, tokenizer, **kw)
    return orch, app.state.frontend, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_many_small_messages_are_refused_untemplated_or_templated_off_the_loop(tokenizer):
    orch, fe, c = client(tokenizer)
    rendered: list[str] = []
    render = fe.render_chat

    def spy(*a, **kw):
        rendered.append(threading.current_thread().name)
        return render(*a, **kw)
    fe.render_chat = spy
    many = [{"role": "user"}] * 129          # each message is at least one token: 129 > 128
    for path in ("/v1/chat/completions", "/tokenize"):
        assert_error(await c.post(path, json=chat_body(messages=many)), 400, "messages", "129 messages")
    assert rendered == []
    # 100 empty messages: no content characters, but a body worth a worker thread
    r = await c.post("/tokenize", json={"messages": [{"role": "user"}] * 100})
    assert r.status_code == 200, r.text
    assert rendered and rendered[-1].startswith("omni-tokenize")


async def test_an_empty_model_is_the_default_as_in_vllm(tokenizer):
    orch, fe, c = client(tokenizer)
    for path, body in (("/v1/chat/completions", chat_body(model="")), ("/v1/completions", {"model": "", "prompt": "hi"}),
                       ("/tokenize", {"model": "", "prompt": "hi"})):
        r = await c.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
    assert_error(await c.post("/v1/chat/completions", json=chat_body(model="other")), 404, "model")


async def test_seed_minus_one_is_no_seed(tokenizer):
    orch, fe, c = client(tokenizer, num_stages=3)
    for body in (chat_body(seed=-1), {"prompt": "hi", "seed": -1},
                 chat_body(sampling_params_list=[{"seed": -1}, {"seed": -1}])):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = await c.post(path, json=body)
        assert r.status_code == 200, r.text
        req = orch.requests[-1]
        assert req.sampling.seed is None and all(o.seed is None for o in req.stage_overrides.values())
    assert (await c.post("/v1/completions", json={"prompt": "hi", "seed": 7})).status_code == 200
    assert orch.requests[-1].sampling.seed == 7


async def test_non_streaming_chat_honours_audio_format(tokenizer):
    orch, fe, c = client(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 2                 # two chunks of 100 float32 samples, +-0.5
    body = chat_body(modalities=["text", "audio"], audio={"voice": "joe", "format": "pcm16"})
    audio = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["audio"]
    raw = base64.b64decode(audio["data"])
    assert audio["format"] == "pcm16" and audio["sample_rate"] == 22050 and not raw.startswith(b"RIFF")
    assert np.frombuffer(raw, "<i2").tolist() == [16384] * 100 + [-16384] * 100
    wav = (await c.post("/v1/chat/completions", json={**body, "audio": {"format": "wav"}})).json()
    assert wav["choices"][0]["message"]["audio"]["format"] == "wav"
    assert base64.b64decode(wav["choices"][0]["message"]["audio"]["data"]).startswith(b"RIFF")
    for fmt in ("mp3", "flac", "opus", "aac"):     # OpenAI's others: refused by name
        assert_error(await c.post("/v1/chat/completions", json={**body, "audio": {"format": fmt}}), 400,
                     "audio.format")
