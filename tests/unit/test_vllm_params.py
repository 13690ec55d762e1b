"""vLLM's and OpenAI's text-route parameters beyond the basic sampling: the ones omni honours
(include_stop_str_in_output, min_tokens holding back stop strings, add_generation_prompt /
continue_final_message, return_token_strs, the list forms of a completion's prompt, null for the
defaults, completions' 16-token default) and the ones it refuses by name instead of ignoring."""

import pytest

from tests.unit.api_fakes import assert_error, chat_body, make, sse_events, tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("field, value", [
    ("guided_json", {"type": "object"}), ("structured_outputs", {"choice": ["a"]}), ("guided_choice", ["a", "b"]),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("min_p", 0.1), ("use_beam_search", True),
    ("allowed_token_ids", [1, 2]), ("bad_words", ["fox"]), ("prompt_logprobs", 1), ("priority", 3),
    ("truncate_prompt_tokens", 5), ("skip_special_tokens", False), ("reasoning_effort", "low"),
    ("documents", [{"title": "t", "text": "x"}]), ("chat_template", "{{ messages }}"), ("echo", True)])
async def test_a_parameter_omni_does_not_honour_is_refused_by_name(tokenizer, field, value):
    orch, c = make(tokenizer)
    assert_error(await c.post("/v1/chat/completions", json=chat_body(**{field: value})), 400, field)
    if field != "echo":   # completions' echo has its own message
        assert_error(await c.post("/v1/completions", json={"prompt": "hi", field: value}), 400, field)
    assert orch.requests == []


async def test_their_no_op_values_pass(tokenizer):
    orch, c = make(tokenizer)
    noop = {"min_p": 0.0, "use_beam_search": False, "length_penalty": 1, "bad_words": [], "skip_special_tokens": True,
            "spaces_between_special_tokens": True, "priority": 0, "functions": None, "echo": False,
            "user": "u1", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True}   # labels: ignored
    assert (await c.post("/v1/chat/completions", json=chat_body(**noop))).status_code == 200
    assert (await c.post("/v1/completions", json={"prompt": "hi", **noop})).status_code == 200


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls"),
    ({"role": "tool", "tool_call_id": "c1", "content": "sunny"}, "messages[1].tool_call_id")])
async def test_a_tool_call_history_is_refused_by_name(tokenizer, message, param):
    orch, c = make(tokenizer)
    body = chat_body(messages=[{"role": "user", "content": "weather?"}, message])
    assert_error(await c.post("/v1/chat/completions", json=body), 400, param, "tool calls are not supported")
    assert_error(await c.post("/tokenize", json={"messages": body["messages"]}), 400, param)


@pytest.mark.parametrize("stream", [False, True])
async def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer, stream):
    orch, c = make(tokenizer, reply="hello world, the quick brown fox")
    for path, body, text in (("/v1/completions", {"prompt": "x"}, lambda ch: ch["text"]),
                             ("/v1/chat/completions", chat_body(), lambda ch: ch["message"]["content"])):
        for include, want in ((True, "hello world"), (False, "hello "), (None, "hello ")):
            r = await c.post(path, json={**body, "stop": ["world"], "include_stop_str_in_output": include,
                                         "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                chunks = [e["choices"][0] for e in sse_events(r.text) if e["choices"]]
                got = "".join(ch.get("text") or ch.get("delta", {}).get("content") or "" for ch in chunks)
                last = chunks[-1]
            else:
                last = r.json()["choices"][0]
                got = text(last)
            assert got == want and last["finish_reason"] == "stop" and last["stop_reason"] == "world", (include, got)


async def test_a_stop_string_counts_only_past_min_tokens(tokenizer):
    orch, c = make(tokenizer, reply="hello world hello world hello")
    ids = tokenizer.encode("hello world hello world hello", add_special_tokens=False)
    first = next(i for i in range(1, len(ids) + 1) if "world" in tokenizer.decode(ids[:i]))   # tokens to the 1st
    for min_tokens, want in ((0, "hello "), (first - 1, "hello "), (first, "hello world hello ")):
        r = await c.post("/v1/completions", json={"prompt": "x", "stop": "world", "min_tokens": min_tokens,
                                                  "max_tokens": 32})
        ch = r.json()["choices"][0]
        assert (ch["text"], ch["stop_reason"]) == (want, "world"), min_tokens


async def test_continue_final_message_and_add_generation_prompt(tokenizer):
    orch, c = make(tokenizer)
    messages = [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hello"}]

    async def rendered(**kw) -> str:
        r = await c.post("/tokenize", json={"messages": messages, **kw})
        assert r.status_code == 200, r.text
        return tokenizer.decode(r.json()["tokens"])

    assert (await rendered()).endswith("hello<|im_end|>\n<|im_start|>assistant\n")
    assert (await rendered(add_generation_prompt=False)).endswith("hello<|im_end|>\n")
    # the model continues the last message: no end of turn, no new turn (vLLM's "prefill")
    assert (await rendered(continue_final_message=True)).endswith("<|im_start|>assistant\nhello")
    assert await rendered(continue_final_message=True, add_generation_prompt=False) == \
        await rendered(continue_final_message=True)
    r = await c.post("/v1/chat/completions", json=chat_body(messages=messages, continue_final_message=True))
    assert r.status_code == 200
    assert tokenizer.decode(orch.requests[-1].prompt_token_ids) == await rendered(continue_final_message=True)
    for path, body in (("/tokenize", {"messages": messages}), ("/v1/chat/completions", chat_body(messages=messages))):
        assert_error(await c.post(path, json={**body, "continue_final_message": True, "add_generation_prompt": True}),
                     400, "continue_final_message", "cannot both be true")


async def test_tokenize_returns_the_token_strings_when_asked(tokenizer):
    orch, c = make(tokenizer)
    body = (await c.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"]) and len(body["token_strs"]) > 1
    assert (await c.post("/tokenize", json={"prompt": "hello world"})).json()["token_strs"] is None   # as vLLM


async def test_a_completions_prompt_in_openais_list_forms(tokenizer):
    orch, c = make(tokenizer)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    for prompt in ("hello world", ["hello world"], ids, [ids]):
        assert (await c.post("/v1/completions", json={"prompt": prompt})).status_code == 200, prompt
        assert orch.requests[-1].prompt_token_ids == ids
    for prompt in (["a", "b"], [ids, ids]):
        assert_error(await c.post("/v1/completions", json={"prompt": prompt}), 400, "prompt",
                     "holds 2 prompts; this server takes one prompt per request")
    assert_error(await c.post("/v1/completions", json={"prompt": [1, "a"]}), 400, "prompt")
    assert_error(await c.post("/v1/completions", json={"prompt": [[]]}), 400, "prompt")


async def test_completions_default_to_16_tokens_and_chat_to_the_deploys(tokenizer):
    orch, c = make(tokenizer, default_max_tokens=50)
    await c.post("/v1/completions", json={"prompt": "hi"})
    assert orch.requests[-1].sampling.max_tokens == 16             # vLLM's and OpenAI's default
    await c.post("/v1/chat/completions", json=chat_body())
    assert orch.requests[-1].sampling.max_tokens == 50


async def test_null_means_the_default(tokenizer):
    orch, c = make(tokenizer)
    r = await c.post("/v1/chat/completions", json=chat_body(stream=None, n=None, include_stop_str_in_output=None))
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = await c.post("/v1/completions", json={"prompt": "hi", "stream": None, "echo": None, "n": None})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"


async def test_stream_options_need_stream(tokenizer):
    orch, c = make(tokenizer)
    for path, body in (("/v1/chat/completions", chat_body()), ("/v1/completions", {"prompt": "hi"})):
        assert_error(await c.post(path, json={**body, "stream_options": {"include_usage": True}}), 400,
                     "stream_options", "needs stream: true")
