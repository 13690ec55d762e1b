"""Random JSON bodies on every POST route: never a 5xx, always an OpenAI error body on 4xx."""

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni.api import build_app
from tests.unit.api_fakes import FakeOrchestrator

_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=12)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"]) | _json},
                                 optional={"content": st.text(max_size=30) | _json})
_plausible = {
    "model": st.sampled_from(["tiny", "other"]) | _json,
    "messages": st.lists(_message, max_size=3) | _json,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 500), max_size=5) | _json,
    "max_tokens": st.integers(-2, 300) | _json,
    "max_completion_tokens": st.integers(-2, 300) | _json,
    "temperature": st.floats(-1, 3) | _json,
    "top_p": st.floats(-1, 2) | _json,
    "top_k": st.integers(-3, 50) | _json,
    "seed": st.integers(-2**64, 2**65) | _json,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _json,
    "n": st.integers(0, 3) | _json,
    "modalities": st.lists(st.sampled_from(["text", "audio", "video"]), max_size=2) | _json,
    "audio": st.fixed_dictionaries({}, optional={"voice": st.sampled_from(["joe", "x"]),
                                                 "format": st.text(max_size=6)}),
    "input": st.text(max_size=30) | _json,
    "voice": st.sampled_from(["joe", "nobody"]) | _json,
    "response_format": st.sampled_from(["wav", "pcm", "mp3"]) | _json,
    "speed": st.floats(0, 5) | _json,
    "level": st.integers(0, 3) | _json,
    "name": st.text(max_size=10) | _json,
    "base": st.sampled_from(["joe", "zed"]) | _json,
    "tokens": st.lists(st.integers(-5, 500) | st.integers(2**63, 2**65), max_size=5) | _json,
    "add_special_tokens": st.booleans() | _json,
}
_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/audio/speech", "/v1/audio/voices", "/v1/omni/sleep",
           "/tokenize", "/detokenize"]
_body = st.dictionaries(st.sampled_from(sorted(_plausible)), st.none(), max_size=8).flatmap(
    lambda keys: st.fixed_dictionaries({k: _plausible[k] for k in keys}))

_state: dict = {}


def _client():
    if "client" not in _state:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        from tests.unit.api_fakes import CHAT_TEMPLATE, CORPUS
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
        t.chat_template = CHAT_TEMPLATE
        orch = FakeOrchestrator(t)
        orch.audio_chunks = 1
        app = build_app(orch, t, served_model_name="tiny", max_model_len=64, speech_entry_stage=1)
        _state["loop"] = asyncio.new_event_loop()
        _state["client"] = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://f")
    return _state["loop"], _state["client"]


def _check(route: str, content: bytes):
    loop, client = _client()
    r = loop.run_until_complete(client.post(route, content=content, headers={"content-type": "application/json"}))
    assert r.status_code < 500, (route, content, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route=st.sampled_from(_ROUTES), body=_body)
def test_random_bodies_never_5xx(route, body):
    _check(route, json.dumps(body).encode())


@settings(max_examples=40, deadline=None)
@given(route=st.sampled_from(_ROUTES), raw=st.binary(max_size=40) | _json.map(lambda v: json.dumps(v).encode()))
def test_random_bytes_never_5xx(route, raw):
    _check(route, raw)


def teardown_module():
    if "client" in _state:
        loop = _state.pop("loop")
        loop.run_until_complete(_state.pop("client").aclose())
        loop.close()
