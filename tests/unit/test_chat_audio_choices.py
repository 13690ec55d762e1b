"""Non-streaming chat with text and audio. A request without an `audio` object (vllm-omni's clients send
none) gets vllm-omni's shape (serving_chat.py chat_completion_full_generator): a text choice, then an
audio choice (index 0 both, as vllm-omni numbers them; message.audio with content null and transcript "";
finish_reason "stop"). vllm-omni's example clients loop `if choice.message.audio: save ... elif
choice.message.content: print`; with one choice holding both they never printed the text. A request with
OpenAI's `audio` object gets OpenAI's shape: one choice, content null, the text as the audio's transcript,
which OpenAI's documented `completion.choices[0].message.audio.data` reads."""

from __future__ import annotations

import base64

import pytest
from openai.types.chat import ChatCompletion

from tests.unit.api_fakes import chat_body, make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


def example_client_loop(cc: ChatCompletion) -> tuple[list[str], list[bytes]]:
    printed, saved = [], []
    for choice in cc.choices:
        if choice.message.audio:
            saved.append(base64.b64decode(choice.message.audio.data))
        elif choice.message.content:
            printed.append(choice.message.content)
    return printed, saved


async def test_text_then_audio_choice(tokenizer):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 2
    d = (await c.post("/v1/chat/completions", json=chat_body(modalities=["text", "audio"]))).json()
    text, audio = d["choices"]
    assert text == {"index": 0, "message": {"role": "assistant", "content": "hello world"}, "logprobs": None,
                    "finish_reason": "stop", "stop_reason": None}
    assert audio["index"] == 0 and audio["finish_reason"] == "stop" and audio["stop_reason"] is None
    assert audio["logprobs"] is None
    assert audio["message"]["role"] == "assistant" and audio["message"]["content"] is None
    rec = audio["message"]["audio"]
    assert rec["transcript"] == "" and rec["id"] == f"audio-{d['id']}" and rec["expires_at"] > 0
    assert base64.b64decode(rec["data"]).startswith(b"RIFF")
    assert d["usage"]["completion_tokens"] == 3           # one usage, the text's, as vllm-omni's
    printed, saved = example_client_loop(ChatCompletion.model_validate(d))
    assert printed == ["hello world"] and len(saved) == 1 and saved[0].startswith(b"RIFF")


async def test_text_only_and_audio_only_have_one_choice(tokenizer):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 1
    d = (await c.post("/v1/chat/completions", json=chat_body())).json()
    assert [ch["message"] for ch in d["choices"]] == [{"role": "assistant", "content": "hello world"}]
    d = (await c.post("/v1/chat/completions", json=chat_body(modalities=["audio"]))).json()
    (only,) = d["choices"]
    assert only["message"]["content"] is None and only["message"]["audio"]["transcript"] == "hello world"
    assert only["finish_reason"] == "stop"
    ChatCompletion.model_validate(d)


async def test_openais_audio_object_gets_openais_one_choice(tokenizer):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 2
    body = chat_body(modalities=["text", "audio"], audio={"voice": "joe", "format": "wav"}, logprobs=True)
    d = (await c.post("/v1/chat/completions", json=body)).json()
    (only,) = d["choices"]
    assert only["index"] == 0 and only["finish_reason"] == "stop" and only["logprobs"] is not None
    assert only["message"]["content"] is None and only["message"]["audio"]["transcript"] == "hello world"
    # OpenAI's documented code (platform.openai.com/docs/guides/audio, audio output)
    completion = ChatCompletion.model_validate(d)
    wav_bytes = base64.b64decode(completion.choices[0].message.audio.data)
    assert wav_bytes.startswith(b"RIFF") and completion.choices[0].message.audio.transcript == "hello world"
