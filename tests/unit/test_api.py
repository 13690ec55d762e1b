"""The HTTP frontend against an in-memory fake orchestrator and a tiny real tokenizer."""

from __future__ import annotations

import re

import pytest

from omni.api.detok import IncrementalDetokenizer, StopMatcher, decoder_for
from omni.errors import RequestTimeout, StageFailed, Unavailable

from tests.unit.api_fakes import (  # noqa: F401 (fixtures; other test files import these names from here too)
    CHAT_TEMPLATE, FakeOrchestrator, anyio_backend, assert_error, chat_body, make, sse_events, tokenizer)

pytestmark = pytest.mark.anyio


# ---- chat

async def test_chat_non_streaming(tokenizer):
    orch, c = make(tokenizer, frontend_index=3)
    r = await c.post("/v1/chat/completions", json=chat_body(temperature=0, max_tokens=50, seed=5, top_k=4))
    assert r.status_code == 200, r.text
    assert r.headers["x-omni-frontend"] == "3"
    d = r.json()
    assert d["object"] == "chat.completion" and d["model"] == "tiny" and d["id"].startswith("chatcmpl-")
    assert d["choices"][0]["message"] == {"role": "assistant", "content": "hello world"}
    assert d["choices"][0]["finish_reason"] == "stop"
    req = orch.requests[0]
    expected_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "say hello"}],
                                                    add_generation_prompt=True, tokenize=False)
    assert req.prompt_token_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert req.sampling.max_tokens == 50 and req.sampling.seed == 5 and req.sampling.top_k == 4
    assert req.sampling.temperature == 0.0 and req.modalities == ("text",) and not req.audio_out
    n_out = len(tokenizer.encode("hello world", add_special_tokens=False)) + 1
    assert d["usage"] == {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": n_out,
                          "total_tokens": len(req.prompt_token_ids) + n_out}


async def test_chat_content_parts_and_length_finish(tokenizer):
    orch, c = make(tokenizer)
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 2, "some_unknown_field": {"x": 1}}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 2
    text = tokenizer.decode(orch.requests[0].prompt_token_ids)
    assert "a\nb" in text and "be brief" in text


async def test_chat_streaming_framing_and_usage(tokenizer):
    orch, c = make(tokenizer)
    r = await c.post("/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == evs[0]["id"] for e in evs)
    assert evs[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in evs if e["choices"])
    assert content == "hello world"
    fin = [e for e in evs if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(fin) == 1 and fin[0]["choices"][0]["finish_reason"] == "stop"
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == \
        len(tokenizer.encode("hello world", add_special_tokens=False)) + 1
    assert all("usage" not in e for e in evs[:-1])     # as vLLM: only the final chunk has it


async def test_stream_finish_rides_on_the_last_token_chunk_as_vllm(tokenizer):
    """vLLM's server: finish_reason on the chunk with the last token, the usage chunk after it,
    `continuous_usage_stats` puts the usage so far on every chunk."""
    _, c = make(tokenizer)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    evs = sse_events((await c.post("/v1/chat/completions", json=chat_body(
        stream=True, max_tokens=2, stream_options=opts))).text)
    assert [e["choices"][0]["delta"] for e in evs[:-1]] == \
        [{"role": "assistant", "content": ""}] + [{"content": tokenizer.decode([t])} for t in ids[:2]]
    assert [e["choices"][0]["finish_reason"] for e in evs[:-1]] == [None, None, "length"]
    prompt = evs[-1]["usage"]["prompt_tokens"]
    assert [e["usage"] for e in evs] == [{"prompt_tokens": prompt, "completion_tokens": n,
                                          "total_tokens": prompt + n} for n in (0, 1, 2, 2)]
    assert evs[-1]["choices"] == []
    # Completions, to EOS: the EOS token's chunk (no text) finishes; no usage asked, none sent.
    evs = sse_events((await c.post("/v1/completions", json={"prompt": "x", "stream": True})).text)
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in evs] == \
        [(tokenizer.decode([t]), None) for t in ids] + [("", "stop")]
    assert all("usage" not in e for e in evs)
    # A stop string: the text before it is on the finishing chunk, nothing follows.
    _, c = make(tokenizer, reply="hello world, the quick brown fox jumps")
    for path, body, text in [("/v1/chat/completions", chat_body(stop="fox", stream=True),
                              lambda ch: ch["delta"]["content"]),
                             ("/v1/completions", {"prompt": "x", "stop": "fox", "stream": True}, lambda ch: ch["text"])]:
        chunks = [e["choices"][0] for e in sse_events((await c.post(path, json=body)).text)]
        assert [ch["finish_reason"] for ch in chunks] == [None] * (len(chunks) - 1) + ["stop"]
        assert "".join(text(ch) for ch in chunks) == "hello world, the quick brown "
        assert text(chunks[-1]) == "wn "    # len("fox") - 1 characters held back, then the rest to the stop


async def test_stop_reason_as_vllm_sends_it(tokenizer):
    """vLLM's stop_reason: the stop string or stop token id that ended the request, null for EOS and
    length; streamed chat has it on the finishing chunk only, streamed completions on every chunk."""
    orch, c = make(tokenizer, reply="hello world, the quick brown fox")
    chat_path, cmpl_path = "/v1/chat/completions", "/v1/completions"

    async def finishes(body_extra: dict) -> list:
        out = []
        for path, body in ((chat_path, chat_body(**body_extra)), (cmpl_path, {"prompt": "x", **body_extra})):
            out.append(((await c.post(path, json=body)).json()["choices"][0]).get("stop_reason", "absent"))
            chunks = [e["choices"][0] for e in sse_events((await c.post(path, json={**body, "stream": True})).text)]
            assert [ch["finish_reason"] is not None for ch in chunks] == [False] * (len(chunks) - 1) + [True]
            before = [ch.get("stop_reason", "absent") for ch in chunks[:-1]]
            assert set(before) == ({"absent"} if path == chat_path else {None}), before
            out.append(chunks[-1].get("stop_reason", "absent"))
        return out

    assert await finishes({}) == [None] * 4                               # EOS
    assert await finishes({"max_tokens": 2}) == [None] * 4                # length
    assert await finishes({"stop": ["zzz", "quick", "the"]}) == ["the"] * 4   # the stop string found first
    # The engine reports the EOS id it stopped on; vLLM's server checks the tokenizer's EOS first
    # and sends null, unless ignore_eos made it an ordinary stop token.
    assert await finishes({"ignore_eos": True}) == [tokenizer.eos_token_id] * 4
    # A stop_token_ids entry: its id, and (as vLLM) its text is left out of the output.
    (dot,) = tokenizer.encode(".", add_special_tokens=False)
    orch.end_token, orch.reply = dot, "hello world"
    assert await finishes({}) == [dot] * 4
    r = await c.post(chat_path, json=chat_body())
    assert r.json()["choices"][0]["message"]["content"] == "hello world"
    chunks = [e["choices"][0] for e in sse_events((await c.post(cmpl_path, json={"prompt": "x", "stream": True})).text)]
    assert "".join(ch["text"] for ch in chunks) == "hello world" and chunks[-1]["text"] == ""
    assert r.json()["usage"]["completion_tokens"] == len(tokenizer.encode("hello world", add_special_tokens=False)) + 1


async def test_stream_without_usage_has_no_usage_field(tokenizer):
    _, c = make(tokenizer)
    r = await c.post("/v1/chat/completions", json=chat_body(stream=True))
    evs = sse_events(r.text)
    assert all("usage" not in e for e in evs) and evs[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stop_string_truncates_and_aborts(tokenizer):
    orch, c = make(tokenizer, reply="hello world, the quick brown fox")
    r = await c.post("/v1/chat/completions", json=chat_body(stop=["quick"]))
    d = r.json()
    assert d["choices"][0]["message"]["content"] == "hello world, the "
    assert d["choices"][0]["finish_reason"] == "stop"
    assert orch.closed == [orch.requests[0].request_id]
    r = await c.post("/v1/chat/completions", json=chat_body(stop="fox", stream=True))
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r.text) if e["choices"])
    assert content == "hello world, the quick brown "


async def test_multibyte_stream_has_no_replacement_chars(tokenizer):
    reply = "héllo 日本語 🙂 done"
    _, c = make(tokenizer, reply=reply)
    ids = tokenizer.encode(reply, add_special_tokens=False)
    assert len(ids) > len(reply.split()) + 6  # really split inside characters
    r = await c.post("/v1/chat/completions", json=chat_body(stream=True))
    deltas = [e["choices"][0]["delta"].get("content", "") for e in sse_events(r.text) if e["choices"]]
    assert "".join(deltas) == reply
    assert not any("\ufffd" in d for d in deltas)
    # One chunk per token (the fake sends one per output; the last is EOS), held-back ones
    # empty, as vLLM streams: a skipped chunk reads as a doubled inter-token gap.
    tokens = [e for e in sse_events(r.text) if e["choices"] and "content" in e["choices"][0]["delta"]
              and "role" not in e["choices"][0]["delta"]]
    assert len(tokens) == len(ids) + 1 and any(e["choices"][0]["delta"]["content"] == "" for e in tokens)
    r = await c.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 64})
    chunks = [e for e in sse_events(r.text) if e["choices"]]
    assert len(chunks) == len(ids) + 1 and "".join(e["choices"][0]["text"] for e in chunks) == reply
    # The EOS token's chunk is the last one: no text, and it carries the finish.
    assert [e["choices"][0]["finish_reason"] for e in chunks] == [None] * len(ids) + ["stop"]
    assert chunks[-1]["choices"][0]["text"] == ""


# ---- errors

@pytest.mark.parametrize("body,param,contains", [
    ({"messages": []}, "messages", "length >= 1"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
    ({}, "messages", "missing"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "wizard"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "<= 1"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", None),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens", None),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, "max_tokens", "128"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature", None),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p", None),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["video"]}, "modalities[0]", "video"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, "modalities", "audio"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop[0]", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type", None),
])
async def test_chat_bad_input_is_400(tokenizer, body, param, contains):
    orch, c = make(tokenizer)
    r = await c.post("/v1/chat/completions", json=body)
    assert_error(r, 400, param, contains)
    assert orch.requests == []


async def test_context_length_message_names_numbers(tokenizer):
    _, c = make(tokenizer, max_model_len=40)
    long = "the quick brown fox " * 6
    r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}],
                                                   "max_tokens": 30})
    err = assert_error(r, 400, "max_tokens", "maximum context length is 40 tokens")
    assert "30 in the completion" in err["message"]
    r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long * 3}]})
    assert_error(r, 400, "messages", "no room")


async def test_max_tokens_limit_and_default(tokenizer):
    orch, c = make(tokenizer, max_tokens_limit=10, default_max_tokens=7)
    assert_error(await c.post("/v1/chat/completions", json=chat_body(max_tokens=11)), 400, "max_tokens", "10")
    r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200 and orch.requests[0].sampling.max_tokens == 7


async def test_malformed_json_and_non_object(tokenizer):
    _, c = make(tokenizer)
    for raw in (b"{not json", b"", b"[1, 2]", b"null", b"\xff\xfe"):
        r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400)


async def test_unknown_model_and_alias(tokenizer):
    _, c = make(tokenizer, model_aliases=["tiny-alias"])
    err = assert_error(await c.post("/v1/chat/completions", json=chat_body(model="gpt-9")), 404, "model")
    assert err["message"] == "The model `gpt-9` does not exist."
    r = await c.post("/v1/chat/completions", json=chat_body(model="tiny-alias"))
    assert r.status_code == 200 and r.json()["model"] == "tiny"


async def test_orchestrator_errors_map_to_status(tokenizer):
    orch, c = make(tokenizer)
    orch.fail = Unavailable("no READY replica for stage 0")
    err = assert_error(await c.post("/v1/chat/completions", json=chat_body()), 503)
    assert err["type"] == "service_unavailable" and "stage 0" in err["message"]
    orch.fail = Unavailable("sleeping")
    assert_error(await c.post("/v1/chat/completions", json=chat_body(stream=True)), 503)
    orch.fail = RuntimeError("bug")
    err = assert_error(await c.post("/v1/completions", json={"prompt": "hi"}), 500)
    assert "Traceback" not in err["message"]


async def test_error_kinds_map_to_status_at_the_edge(tokenizer):
    orch, c = make(tokenizer)
    for error, status, type_ in ((StageFailed(0, "r0", "prompt too long", kind="client", entry_rid="x"), 400,
                                  "invalid_request_error"),
                                 (StageFailed(1, "r1", "replica is dead", kind="unavailable"), 503,
                                  "service_unavailable"),
                                 (StageFailed(0, "r0", "engine step failed"), 500, "stage_error"),
                                 (RequestTimeout("request x timed out after 1 s"), 504, "timeout")):
        orch.fail = error
        err = assert_error(await c.post("/v1/completions", json={"prompt": "hi"}), status)
        # a refused request reads the engine's own words; the others say where it failed
        assert err["type"] == type_ and (error.detail if status == 400 else str(error)) == err["message"]


async def test_error_mid_stream_is_an_event(tokenizer):
    orch, c = make(tokenizer, reply="hello world, the quick brown fox")
    orch.fail_after = 2
    r = await c.post("/v1/chat/completions", json=chat_body(stream=True))
    assert r.status_code == 200
    evs = sse_events(r.text)
    assert evs[-1]["error"]["type"] == "stage_error" and "boom" in evs[-1]["error"]["message"]
    assert orch.closed == [orch.requests[0].request_id]


async def test_unknown_route_and_method(tokenizer):
    _, c = make(tokenizer)
    assert_error(await c.get("/v1/nothing"), 404)
    assert_error(await c.get("/v1/chat/completions"), 405)


# ---- completions

async def test_completions_string_and_ids(tokenizer):
    orch, c = make(tokenizer)
    r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 1})
    d = r.json()
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] == "length"
    assert d["choices"][0]["text"] == tokenizer.decode(tokenizer.encode("hello world", add_special_tokens=False)[:1])
    assert orch.requests[0].prompt_token_ids == tokenizer.encode("hello")
    r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "stream": True,
                                              "stream_options": {"include_usage": True}})
    evs = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in evs if e["choices"]) == "hello world"
    assert evs[-1]["usage"]["prompt_tokens"] == 3
    assert all(e["object"] == "text_completion" for e in evs)
    assert_error(await c.post("/v1/completions", json={"prompt": [99999]}), 400, "prompt", "vocabulary")
    assert_error(await c.post("/v1/completions", json={"prompt": ""}), 400, "prompt")


# ---- models, health, metrics, sleep, auth

async def test_models(tokenizer):
    _, c = make(tokenizer, model_aliases=["b"])
    d = (await c.get("/v1/models")).json()
    assert d["object"] == "list" and [m["id"] for m in d["data"]] == ["tiny", "b"]
    assert all(m["owned_by"] == "omni" and m["object"] == "model" for m in d["data"])
    assert [m["root"] for m in d["data"]] == ["tiny", "tiny"]      # no path given: the served name
    # vLLM's ModelCard.permission: one ModelPermission with its defaults, an id per card kept for the process.
    perms = [m["permission"] for m in d["data"]]
    assert all(len(p) == 1 and re.fullmatch(r"modelperm-[0-9a-f]{32}", p[0]["id"]) for p in perms)
    assert perms[0][0]["id"] != perms[1][0]["id"]
    assert {k: v for k, v in perms[0][0].items() if k != "id"} == {
        "object": "model_permission", "created": d["data"][0]["created"], "allow_create_engine": False,
        "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
        "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    assert (await c.get("/v1/models/b")).json()["permission"] == perms[1]
    assert [m["permission"] for m in (await c.get("/v1/models")).json()["data"]] == perms
    _, c = make(tokenizer, served_model_name=["a", "b"], model_path="/models/Qwen3-Omni")
    assert [m["root"] for m in (await c.get("/v1/models")).json()["data"]] == ["/models/Qwen3-Omni"] * 2  # vLLM's: MODEL


async def test_health(tokenizer):
    orch, c = make(tokenizer)
    r = await c.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "healthy"   # vllm-omni's body (vLLM's is empty)
    orch.ok, orch.reason = False, "stage 1 has no READY replica"
    r = await c.get("/health")
    assert r.status_code == 503 and r.json()["reason"] == "stage 1 has no READY replica"


async def test_probe_fast_path_answers_like_the_routes(tokenizer):
    """/health, /ping, /v1/models and /version are answered before Starlette's routing unless the
    request has a body: both ways give the same answer, the frontend header, and are counted."""
    orch, c = make(tokenizer, frontend_index=2, model_aliases=["b"], api_key="k")
    auth = {"Authorization": "Bearer k"}
    for path in ("/health", "/ping", "/v1/models", "/version"):
        fast = await c.get(path, headers=auth)
        routed = await c.request("GET", path, headers=auth, content=b"x")   # a body: the routed handler
        assert fast.status_code == routed.status_code == 200, (path, fast.text, routed.text)
        assert fast.json() == routed.json() and fast.headers["x-omni-frontend"] == "2"
        assert fast.headers["content-type"] == "application/json"
    assert [m["id"] for m in (await c.get("/v1/models", headers=auth)).json()["data"]] == ["tiny", "b"]
    assert_error(await c.get("/v1/models"), 401)   # the key still guards the fast path
    orch.ok, orch.reason = False, "no READY replica for talker"
    r = await c.post("/ping")
    assert r.status_code == 503 and r.json() == {"status": "unhealthy", "reason": "no READY replica for talker"}
    text = (await c.get("/metrics")).text
    assert 'omni_api_requests_total{frontend="2",route="/health",status="200"} 2' in text
    assert 'omni_api_requests_total{frontend="2",route="/ping",status="503"} 1' in text
    assert 'omni_api_requests_total{frontend="2",route="/v1/models",status="401"} 1' in text


async def test_metrics(tokenizer):
    _, c = make(tokenizer, frontend_index=1)
    await c.post("/v1/chat/completions", json=chat_body())
    await c.post("/v1/chat/completions", json=chat_body(n=3))
    text = (await c.get("/metrics")).text
    assert 'omni_api_requests_total{frontend="1",route="/v1/chat/completions",status="200"} 1' in text
    assert 'omni_api_requests_total{frontend="1",route="/v1/chat/completions",status="400"} 1' in text
    assert 'omni_api_request_duration_seconds_count{frontend="1",route="/v1/chat/completions"} 2' in text
    assert 'omni_api_time_to_first_output_seconds_count{frontend="1",route="/v1/chat/completions"} 1' in text
    assert 'omni_api_requests_in_flight{frontend="1"} 1' in text  # this /metrics request itself
    assert text.endswith("omni_orchestrator_requests 7\n")


async def test_sleep_wakeup(tokenizer):
    orch, c = make(tokenizer)
    assert (await c.get("/v1/omni/is_sleeping")).json() == {"is_sleeping": False}
    assert (await c.post("/v1/omni/sleep", json={"level": 2})).json()["level"] == 2
    assert (await c.get("/v1/omni/is_sleeping")).json() == {"is_sleeping": True}
    assert (await c.post("/v1/omni/wakeup")).status_code == 200
    assert orch.sleeping is False
    assert_error(await c.post("/v1/omni/sleep", json={"level": 3}), 400, "level")


async def test_api_key(tokenizer):
    _, c = make(tokenizer, api_key="s3cret")
    err = assert_error(await c.get("/v1/models"), 401)
    assert err["code"] == "invalid_api_key"
    assert_error(await c.post("/v1/chat/completions", json=chat_body(),
                              headers={"Authorization": "Bearer wrong"}), 401)
    r = await c.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.headers["x-omni-frontend"] == "0"
    assert (await c.get("/health")).status_code == 200
    assert (await c.get("/metrics")).status_code == 200


async def test_several_served_names_and_api_keys_like_vllm(tokenizer):
    """--served-model-name a b / --api-key k1 k2: both names are answered to and listed (a first, the
    one reported), either key opens /v1, any other key is a 401 in OpenAI's error shape."""
    _, c = make(tokenizer, served_model_name=["a", "b"], model_aliases=["z"], api_key=["k1", "k2"])
    for key in ("k1", "k2"):
        auth = {"Authorization": f"Bearer {key}"}
        models = (await c.get("/v1/models", headers=auth)).json()["data"]
        assert [m["id"] for m in models] == ["a", "b", "z"]
        for name in ("a", "b", "z"):
            r = await c.post("/v1/chat/completions", json=chat_body(model=name), headers=auth)
            assert r.status_code == 200 and r.json()["model"] == "a", r.text
    for auth in ({"Authorization": "Bearer k3"}, {"Authorization": "Bearer k1k2"}, {}):
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(model="a"), headers=auth), 401)
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert_error(await c.post("/v1/chat/completions", json=chat_body(model="c"),
                              headers={"Authorization": "Bearer k2"}), 404, "model")
    assert 'model_name="a"' in (await c.get("/metrics")).text


async def test_control_routes_take_their_own_key(tokenizer):
    orch, c = make(tokenizer, api_key="user", control_api_key="admin")
    user, admin = {"Authorization": "Bearer user"}, {"Authorization": "Bearer admin"}
    err = assert_error(await c.post("/v1/omni/sleep", json={}, headers=user), 401, contains="control API key")
    assert err["code"] == "invalid_api_key"
    assert orch.sleeping is False
    assert (await c.post("/v1/omni/sleep", json={}, headers=admin)).status_code == 200
    assert orch.sleeping is True
    # Reading the state and ordinary routes stay on the user key; the admin key is not a user key.
    assert (await c.get("/v1/omni/is_sleeping", headers=user)).json() == {"is_sleeping": True}
    assert_error(await c.get("/v1/models", headers=admin), 401)
    assert_error(await c.post("/v1/omni/wakeup", headers=user), 401)
    assert (await c.post("/v1/omni/wakeup", headers=admin)).status_code == 200


async def test_control_routes_can_be_turned_off(tokenizer):
    orch, c = make(tokenizer, control_routes=False)
    for path in ("/v1/omni/sleep", "/v1/omni/wakeup"):
        err = assert_error(await c.post(path, json={}), 403, contains="--disable-control-routes")
        assert err["type"] == "permission_error"
    assert orch.sleeping is False
    assert (await c.get("/v1/omni/is_sleeping")).status_code == 200


async def test_vllms_sleep_paths_are_the_same_routes_behind_the_same_keys(tokenizer):
    """vLLM's POST /sleep?level=&mode=, POST /wake_up and GET /is_sleeping (its dev mode's, outside /v1): what
    tools that drive vLLM's sleep call. The API key guards them as it guards /v1 (vLLM's guards none)."""
    orch, c = make(tokenizer, api_key="user")
    user = {"Authorization": "Bearer user"}
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        assert_error(await c.request(method, path), 401)
    assert orch.sleeping is False
    r = await c.post("/sleep?level=2&mode=wait", headers=user)
    assert r.status_code == 200 and r.json()["level"] == 2 and r.json()["mode"] == "wait", r.text
    assert (await c.get("/is_sleeping", headers=user)).json() == {"is_sleeping": True}
    assert_error(await c.post("/wake_up?tags=weights", headers=user), 400, "tags")
    assert (await c.post("/wake_up", headers=user)).status_code == 200 and orch.sleeping is False
    orch, c = make(tokenizer, api_key="user", control_api_key="admin")
    assert_error(await c.post("/sleep", headers=user), 401, contains="control API key")
    assert (await c.post("/sleep", headers={"Authorization": "Bearer admin"})).status_code == 200
    orch, c = make(tokenizer, control_routes=False)
    for path in ("/sleep", "/wake_up"):
        assert_error(await c.post(path), 403, contains="--disable-control-routes")
    assert orch.sleeping is False
    orch, c = make(tokenizer)
    for path in ("/sleep", "/wake_up"):   # a body not sent as JSON is refused, as /v1/omni/sleep's
        r = await c.post(path, content=b'{"stage_ids": [0]}', headers={"Content-Type": "text/plain"})
        assert_error(r, 400, contains="Content-Type")
    assert orch.sleeping is False


async def test_tokenize_and_detokenize_like_vllm(tokenizer):
    _, c = make(tokenizer, api_key="k")
    auth = {"Authorization": "Bearer k"}
    assert_error(await c.post("/tokenize", json={"prompt": "hi"}), 401)
    r = await c.post("/tokenize", json={"model": "tiny", "prompt": "hello world"}, headers=auth)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["tokens"] == tokenizer.encode("hello world") and doc["count"] == len(doc["tokens"])
    assert doc["max_model_len"] == 128
    chat = (await c.post("/tokenize", json={"messages": [{"role": "user", "content": "say hello"}]},
                         headers=auth)).json()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "say hello"}],
                                             add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    back = (await c.post("/detokenize", json={"tokens": doc["tokens"]}, headers=auth)).json()
    assert back == {"prompt": tokenizer.decode(doc["tokens"])}
    assert_error(await c.post("/tokenize", json={}, headers=auth), 400, "prompt", "exactly one")
    assert_error(await c.post("/tokenize", json={"prompt": "a", "messages": []}, headers=auth), 400, "messages")
    assert_error(await c.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user"}]}, headers=auth), 400, "prompt")
    assert_error(await c.post("/detokenize", json={"tokens": [-1]}, headers=auth), 400, "tokens[0]", ">= 0")
    assert_error(await c.post("/detokenize", json={"tokens": [10**6]}, headers=auth), 400, "tokens", "vocabulary")
    assert_error(await c.post("/detokenize", json={"tokens": "x"}, headers=auth), 400, "tokens")
    assert_error(await c.post("/tokenize", json={"model": "other", "prompt": "a"}, headers=auth), 404, "model")


# ---- audio

# ---- detokenizer units

def test_detok_matches_full_decode_for_every_split(tokenizer):
    text = "aé日🙂 hello wörld"
    ids = tokenizer.encode(text, add_special_tokens=False)
    dec = decoder_for(tokenizer)
    for step in (1, 2, 3):
        d = IncrementalDetokenizer(dec, [1, 2])
        deltas = [d.push(ids[i:i + step]) for i in range(0, len(ids), step)] + [d.flush()]
        assert "".join(deltas) == text and not any("\ufffd" in x for x in deltas)


def test_detok_flush_emits_incomplete_tail(tokenizer):
    ids = tokenizer.encode("日", add_special_tokens=False)
    d = IncrementalDetokenizer(decoder_for(tokenizer))
    assert d.push(ids[:1]) == ""
    assert d.flush() == "\ufffd"


def test_stop_matcher_across_deltas():
    m = StopMatcher(["STOP", "##"])
    out = "".join(m.feed(x) for x in ["ab", "cS", "T", "O", "Pxyz"])
    assert out == "abc" and m.stopped and m.matched == "STOP"
    m = StopMatcher(["BC", "AB", "B"])     # the match that ends first wins; on a tie, the first listed
    assert m.feed("xABC") == "x" and m.matched == "AB"
    m = StopMatcher(["B", "BC"])
    assert m.feed("xBC") == "x" and m.matched == "B"
    m = StopMatcher(["STOP"])
    assert m.feed("abcST") == "ab" and m.flush() == "cST" and not m.stopped


async def test_max_tokens_defaults_to_the_contexts_room_when_the_deploy_sets_none(tokenizer):
    """vLLM's default for an omitted max_tokens: what the context leaves after the prompt (not 256)."""
    orch, c = make(tokenizer, max_model_len=4096)
    r = await c.post("/v1/chat/completions", json=chat_body())
    n_prompt = len(orch.requests[0].prompt_token_ids)
    assert r.status_code == 200 and orch.requests[0].sampling.max_tokens == 4096 - n_prompt
