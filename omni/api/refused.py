"""Parameters of OpenAI's and vLLM's text routes that omni does not honour.

The text routes ignore fields they do not know (OpenAI clients send extras), so a parameter
that changes what the answer must be (structured output, beam search, a vocabulary limit) is
declared here: a request setting it to anything but its no-op value is refused by name with the
reason, never answered as if it were not there. Labels that change nothing (`LABELS`: `user`,
`session_id`, `prompt_cache_key` ...) stay ignored, as vLLM ignores them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec


def refused(allowed: list) -> msgspec.Meta:
    """A parameter omni refuses by name unless it is one of `allowed` (its schema says so)."""
    return msgspec.Meta(extra_json_schema={"enum": allowed})


_STRUCTURED = "structured output (guided decoding) is not supported by this server"
_BEAM = "beam search is not supported by this server"

# name: (the values that do nothing, why another value is refused)
REFUSED: dict[str, tuple[list, str]] = {
    "structured_outputs": ([None], _STRUCTURED),
    "guided_json": ([None], _STRUCTURED),
    "guided_regex": ([None], _STRUCTURED),
    "guided_choice": ([None], _STRUCTURED),
    "guided_grammar": ([None], _STRUCTURED),
    "guided_decoding_backend": ([None], _STRUCTURED),
    "guided_whitespace_pattern": ([None], _STRUCTURED),
    "functions": ([None, []], "function calling is not supported by this server"),
    "function_call": ([None, "none"], "function calling is not supported by this server"),
    "use_beam_search": ([None, False], _BEAM),
    "length_penalty": ([None, 1, 1.0], _BEAM),
    "min_p": ([None, 0, 0.0], "min_p sampling is not supported by this server"),
    "allowed_token_ids": ([None], "a vocabulary limit is not supported; logit_bias -100 excludes a token"),
    "bad_words": ([None, []], "bad_words is not supported; logit_bias -100 excludes a token"),
    "logit_bias_processors": ([None], "custom logits processors are not supported"),
    "logits_processors": ([None], "custom logits processors are not supported"),
    "prompt_logprobs": ([None], "prompt logprobs are not supported by this server"),
    "logprob_token_ids": ([None], "logprobs of chosen token ids are not supported; top logprobs are"),
    "return_tokens_as_token_ids": ([None, False], "logprob tokens are always their text here"),
    "truncate_prompt_tokens": ([None], "prompts are never truncated: one over the context is a 400"),
    "truncation_side": ([None], "prompts are never truncated: one over the context is a 400"),
    "skip_special_tokens": ([None, True], "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ([None, True], "special tokens are always left out of the text"),
    "prompt_embeds": ([None], "prompts are text or token ids; embeddings are not supported"),
    "priority": ([None, 0], "this server does not schedule by priority"),
    "cache_salt": ([None], "the prefix cache is not salted per request by this server"),
    "kv_transfer_params": ([None], "disaggregated prefill is not supported by this server"),
    "vllm_xargs": ([None], "vLLM's extra arguments reach no stage of this server"),
    "thinking_token_budget": ([None], "a thinking budget is not supported by this server"),
    "reasoning_effort": ([None], "set it in chat_template_kwargs if the chat template reads it"),
    "prediction": ([None], "predicted outputs are not supported by this server"),
    "web_search_options": ([None], "web search is not supported by this server"),
    "moderation": ([None], "moderation is not supported by this server: no model checks the input or output"),
    "verbosity": ([None], "verbosity is not supported by this server"),
    "documents": ([None, []], "documents (RAG) are not passed to the chat template by this server"),
    "chat_template": ([None], "the model's own chat template is used; a request cannot bring one"),
    "return_token_ids": ([None, False], "token ids in the answer are not supported; /tokenize gives a text's"),
    "return_prompt_text": ([None, False], "the templated prompt is not returned; /tokenize with messages gives it"),
    "repetition_detection": ([None], "repetition detection is not supported by this server"),
    "watermarking": ([None, False], "watermarking is not supported by this server"),
    "mm_processor_kwargs": ([None, {}], "the multimodal processor takes no per-request arguments here"),
    "media_io_kwargs": ([None, {}], "media loading takes no per-request arguments here (omni fetches no URL)"),
    "ec_transfer_params": ([None], "disaggregated encoding is not supported by this server"),
    "include_reasoning": ([None, True], "reasoning is not split from the content here (no reasoning parser); "
                          "chat_template_kwargs {\"enable_thinking\": false} turns thinking off where the template reads it"),
    "stream_interval": ([None, 1], "a stream sends the tokens as they come; chunks of N tokens are not supported"),
    # vllm-omni's: a `metrics` object per stage in the answer (its benchmarks ask for it)
    "return_stage_metrics": ([None, False], "per-stage metrics are on /metrics and in `omni status`"),
}

# Fields of vLLM's and OpenAI's requests that cannot change the answer here, so they stay ignored as vLLM
# ignores them (a test holds every field of vLLM 0.32's and the openai client's requests to be omni's own,
# refused, or here): labels for the caller's logs, caches and routers, and the render endpoints' options,
# which vLLM ignores on chat and completions (omni has no render endpoint and returns no routed experts).
LABELS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier", "session_id",
          "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "return_token_offsets",
          "mm_payload", "return_mm_kwargs", "routed_experts_prompt_start")

# The same names as struct fields, so that decoding keeps them and openapi.json states the
# values that pass (a mixin of the text requests).
RefusedParams = msgspec.defstruct(
    "RefusedParams", [(name, Annotated[Any, refused(ok)], None) for name, (ok, _) in REFUSED.items()],
    kw_only=True)


def first_refused(req: Any, table: dict[str, tuple[list, str]] = REFUSED) -> tuple[str, str] | None:
    """(name, why) of the first parameter of `table` set to something other than a no-op value."""
    for name, (ok, why) in table.items():
        value = getattr(req, name, None)
        # Python's equality, as schema-driven clients read the enum: false is 0, 1.0 is 1
        if value is not None and not any(value == v for v in ok):
            return name, why
    return None
