"""The fields of vLLM 0.32's and the openai client's chat and completion requests: each is omni's own,
refused by name unless set to its no-op value (api/refused.py), or a label that cannot change the answer
(refused.LABELS), which is answered as vLLM answers it. A field a newer vLLM or client adds fails the
first test until it is sorted into one of those."""

from __future__ import annotations

import pytest

from omni.api import protocol as P
from tests.unit.api_fakes import assert_error, chat_body, make, sse_events, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


def _vllm_requests():
    pytest.importorskip("vllm")
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    except ImportError:     # older vLLM
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    return ChatCompletionRequest, CompletionRequest


def test_every_field_of_vllms_and_openais_requests_is_taken_refused_or_a_label():
    from omni.api.refused import LABELS

    chat, completion = _vllm_requests()
    openai_chat = pytest.importorskip("openai.types.chat.completion_create_params")
    openai_completion = pytest.importorskip("openai.types.completion_create_params")
    ours_chat = set(P.ChatCompletionRequest.__struct_fields__) | set(LABELS)
    ours_completion = set(P.CompletionRequest.__struct_fields__) | set(LABELS)
    assert sorted(set(chat.model_fields) - ours_chat) == []
    assert sorted(set(completion.model_fields) - ours_completion) == []
    assert sorted(set(openai_chat.CompletionCreateParamsBase.__annotations__) - ours_chat) == []
    assert sorted(set(openai_completion.CompletionCreateParamsBase.__annotations__) - ours_completion) == []


async def test_include_reasoning_false_is_refused_by_name(tokenizer):  # noqa: F811
    """No reasoning parser splits the thinking out, so false would answer with the reasoning left in."""
    orch, c = make(tokenizer)
    assert_error(await c.post("/v1/chat/completions", json=chat_body(include_reasoning=False)), 400,
                 "include_reasoning", "enable_thinking")
    assert orch.requests == []
    assert (await c.post("/v1/chat/completions", json=chat_body(include_reasoning=True))).status_code == 200


async def test_a_stream_interval_above_one_is_refused_by_name(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    assert_error(await c.post("/v1/chat/completions", json=chat_body(stream=True, stream_interval=4)), 400,
                 "stream_interval")
    assert_error(await c.post("/v1/completions", json={"prompt": "hi", "stream": True, "stream_interval": 2}),
                 400, "stream_interval")
    assert_error(await c.post("/v1/chat/completions", json=chat_body(stream_interval=0)), 400, "stream_interval")
    assert orch.requests == []
    r = await c.post("/v1/chat/completions", json=chat_body(stream=True, stream_interval=1))
    assert r.status_code == 200 and sse_events(r.text)


LABELLED = {"session_id": "conv-7", "prompt_cache_key": "k1", "prompt_cache_retention": "24h",
            "prompt_cache_options": {"mode": "explicit", "ttl": "1h"}, "safety_identifier": "user-hash",
            "return_token_offsets": True, "mm_payload": "none", "return_mm_kwargs": False,
            "routed_experts_prompt_start": 3}


async def test_labels_are_answered_as_without_them(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    plain = (await c.post("/v1/chat/completions", json=chat_body())).json()
    labelled = (await c.post("/v1/chat/completions", json=chat_body(**LABELLED))).json()
    assert labelled["choices"] == plain["choices"] and labelled["usage"] == plain["usage"]
    r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **LABELLED})
    assert r.status_code == 200, r.text


def test_every_field_of_openais_speech_request_is_taken():
    """Speech refuses a field it does not know: the openai client's must all be its own."""
    openai_speech = pytest.importorskip("openai.types.audio.speech_create_params")
    assert sorted(set(openai_speech.SpeechCreateParams.__annotations__) - set(P.SpeechRequest.__struct_fields__)) == []


@pytest.mark.parametrize("field, value", [("foo", 1), ("x_vector_only_mode", True), ("initial_codec_chunk_frames", 4),
                                          ("non_streaming_mode", True)])
async def test_an_unknown_speech_field_is_refused_by_name(tokenizer, field, value):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    assert_error(await c.post("/v1/audio/speech", json={"input": "Hi.", field: value}), 400, field, field)
    assert orch.requests == []
