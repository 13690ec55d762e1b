"""Review fixes of the text routes: message counts, `model: ""`, vLLM's request fields, seeds,
audio formats (the frontend against test_api's fake orchestrator and tiny tokenizer)."""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import pytest

from omni.api import build_app
from tests.unit.api_fakes import FakeOrchestrator, assert_error, chat_body, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio


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
        # a later stage's entry without a seed draws its own (an unset override would keep the request's)
        assert req.sampling.seed is None and all(o.seed is not None for o in req.stage_overrides.values())
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
    for fmt in ("mp3", "flac", "opus", "aac"):     # OpenAI's others: whole files (test_audio_formats)
        got = (await c.post("/v1/chat/completions", json={**body, "audio": {"format": fmt}})).json()
        assert got["choices"][0]["message"]["audio"]["format"] == fmt
    assert_error(await c.post("/v1/chat/completions", json={**body, "audio": {"format": "ogg"}}), 400, "audio.format")


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer):
    """test_api's tokenizer with a post-processor that puts a BOS (<|im_start|>) first, as Llama's does."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    bos = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    t.chat_template = tokenizer.chat_template
    return t


async def test_add_special_tokens_is_honoured_with_vllms_defaults(bos_tokenizer):
    orch, fe, c = client(bos_tokenizer)
    bos = bos_tokenizer.bos_token_id
    plain = bos_tokenizer.encode("say hello", add_special_tokens=False)

    async def prompt(path, body):
        r = await c.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"] if path == "/tokenize" else orch.requests[-1].prompt_token_ids

    assert await prompt("/v1/completions", {"prompt": "say hello"}) == [bos] + plain       # default true
    assert await prompt("/v1/completions", {"prompt": "say hello", "add_special_tokens": False}) == plain
    chat = await prompt("/v1/chat/completions", chat_body())                                 # default false
    assert await prompt("/v1/chat/completions", chat_body(add_special_tokens=True)) == [bos] + chat
    assert await prompt("/tokenize", {"prompt": "say hello"}) == [bos] + plain
    assert await prompt("/tokenize", {"messages": chat_body()["messages"]}) == chat
    assert await prompt("/tokenize", {"messages": chat_body()["messages"], "add_special_tokens": True}) == [bos] + chat


@pytest.mark.parametrize("name, value, noop", [
    ("return_token_ids", True, False), ("return_prompt_text", True, False),
    ("repetition_detection", {"max_pattern_size": 8}, None), ("watermarking", True, False),
    ("mm_processor_kwargs", {"fps": 2}, {}), ("media_io_kwargs", {"video": {"num_frames": 8}}, {}),
    ("ec_transfer_params", {"x": 1}, None)])
async def test_vllm_fields_that_change_the_answer_are_refused_by_name(tokenizer, name, value, noop):
    orch, fe, c = client(tokenizer)
    for path, body in (("/v1/chat/completions", chat_body()), ("/v1/completions", {"prompt": "hi"})):
        assert_error(await c.post(path, json={**body, name: value}), 400, name)
        assert (await c.post(path, json={**body, name: noop})).status_code == 200


async def test_a_sampling_parameter_the_pipeline_refuses_is_a_400_naming_it(tokenizer):
    orch, fe, c = client(tokenizer)
    fe.refused_sampling = {"logit_bias": "its thinker captures hidden states"}
    for path, body in (("/v1/chat/completions", chat_body()), ("/v1/completions", {"prompt": "hi"})):
        assert_error(await c.post(path, json={**body, "logit_bias": {"5": 10}}), 400, "logit_bias",
                     "not supported by this pipeline: its thinker captures hidden states")
        assert (await c.post(path, json={**body, "logit_bias": {}})).status_code == 200
        assert (await c.post(path, json=body)).status_code == 200
    assert len(orch.requests) == 4
