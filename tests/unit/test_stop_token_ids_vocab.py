"""stop_token_ids outside the prompt stage's vocabulary are a 400 naming the field at the frontend, as its
prompt token ids are: vLLM's stage refused them (out-of-vocab token ids ... Vocabulary size N) with
param null and no field named, after the request had reached the stage. vllm-omni's example client sends
the real model's <|im_end|> (151645) as entry 0's stop id."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import assert_error, chat_body, make, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio


async def test_stop_token_ids_outside_the_vocabulary_are_a_400_naming_them(tokenizer):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    vocab = len(tokenizer)
    for path, base in (("/v1/chat/completions", chat_body()), ("/v1/completions", {"prompt": "hi"})):
        for bad in (vocab, 151645):
            r = await c.post(path, json={**base, "stop_token_ids": [0, bad]})
            assert_error(r, 400, param="stop_token_ids",
                         contains=f"stop_token_ids entry {bad} is outside the vocabulary [0, {vocab})")
        assert (await c.post(path, json={**base, "stop_token_ids": [vocab - 1]})).status_code == 200
    thinker = {"temperature": 0.4, "max_tokens": 12, "stop_token_ids": [151645]}
    r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[thinker]))
    assert_error(r, 400, param="sampling_params_list[0].stop_token_ids", contains="entry 151645 is outside")
    assert len(orch.requests) == 2          # none of the refused ones reached a stage
    r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[{**thinker, "stop_token_ids": [1]}]))
    assert r.status_code == 200, r.text
    assert orch.requests[-1].sampling.stop_token_ids == (1,)
