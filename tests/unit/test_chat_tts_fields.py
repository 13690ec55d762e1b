"""vllm-omni's TTS fields in a chat body (its benchmark merges a Seed-TTS row's ref_audio, ref_text ... into
the chat request): refused by name with speech's reasons, never answered in the default voice; unset or
a no-op value passes. vLLM 0.32's own chat request has none of them."""

from __future__ import annotations

import pytest

from omni.api.protocol import CHAT_SPEECH_REFUSED
from tests.unit.api_fakes import assert_error, chat_body, make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio

SET = {"ref_audio": "x", "ref_text": "hello", "task_type": "Base", "language": "English", "instructions": "sad",
       "speaker_embedding": [0.1], "x_vector_only_mode": True, "max_new_tokens": 100, "extra_params": {"a": 1}}


def test_every_field_has_a_case():
    assert set(SET) == set(CHAT_SPEECH_REFUSED)


@pytest.mark.parametrize("field", sorted(SET))
async def test_a_tts_field_in_chat_is_refused_by_name(tokenizer, field):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1, audio_out=True)
    body = chat_body(modalities=["text", "audio"], **{field: SET[field]})
    assert_error(await c.post("/v1/chat/completions", json=body), 400, field, CHAT_SPEECH_REFUSED[field][1])
    assert orch.requests == []


async def test_no_op_values_pass(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    body = chat_body(ref_audio=None, ref_text="", language=None, instructions="", speaker_embedding=[],
                     x_vector_only_mode=False, extra_params={}, max_new_tokens=None, task_type=None)
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
