"""logprobs / top_logprobs (issue 15, item 3): the torch engine's raw logprobs
against HF transformers in float32, vLLM's logprob dicts, the stage wire, and both response
shapes, streamed and not, through the HTTP frontend on a fake orchestrator. Their request checks
(400s) are with the other parameters' in test_sampling_params.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from omni.api import build_app
from omni.engines.logprobs import Logprobs, from_vllm
from omni.stage import messages as m
from tests.unit.api_fakes import FakeOrchestrator, chat_body, sse_events, tokenizer  # noqa: F401
from tests.unit.test_torch_lm import PROMPTS, engine, req, run, tiny, tokens  # noqa: F401 (fixtures)


# ---- the torch engine ---------------------------------------------------------------

def hf_raw_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax of the HF model's logits (float32) at the positions that produced `out`."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_torch_engine_logprobs_are_raw_log_softmax_of_the_model(engine, tiny):
    _, model = tiny
    n = 8
    # Two at once in one batch; the shaped one samples (temperature, penalty, bias) yet reports the
    # raw logprobs, as vLLM's default logprobs_mode does; the third asks for none.
    outs, _ = run(engine, {0: [req("g", PROMPTS["b"], max_tokens=n, logprobs=5),
                               req("s", PROMPTS["c"], max_tokens=n, logprobs=3, temperature=0.9, seed=3,
                                   repetition_penalty=1.5, logit_bias={42: 4.0}),
                               req("none", PROMPTS["a"], max_tokens=n)],
                           2: [req("late", PROMPTS["d"], max_tokens=n, logprobs=0)]})
    for rid, prompt, k in (("g", PROMPTS["b"], 5), ("s", PROMPTS["c"], 3), ("late", PROMPTS["d"], 0)):
        got = tokens(outs[rid])
        ref = hf_raw_logprobs(model, prompt, got)
        assert all(len(o.logprobs) == len(o.token_ids) == 1 for o in outs[rid])
        sampled = [o.logprobs.sampled[0] for o in outs[rid]]
        want = [float(ref[i, t]) for i, t in enumerate(got)]
        assert sampled == pytest.approx(want, abs=1e-4)
        for i, o in enumerate(outs[rid]):
            vals, ids = torch.topk(ref[i], k)
            assert o.logprobs.top_ids[0] == ids.tolist()
            assert o.logprobs.top[0] == pytest.approx(vals.tolist(), abs=1e-4)
        if rid == "g":      # greedy: the sampled token is the best
            assert all(o.logprobs.top_ids[0][0] == o.token_ids[0] for o in outs[rid])
    assert all(o.logprobs is None for o in outs["none"])


def test_torch_engine_refuses_too_many_logprobs(engine):
    from omni.engines.base import EngineError

    with pytest.raises(EngineError, match="logprobs must be in"):
        engine.add_request(req("big", PROMPTS["a"], logprobs=21))


# ---- vLLM's logprob dicts ----------------------------------------------------------

def lp(value, rank):
    return SimpleNamespace(logprob=value, rank=rank, decoded_token=None)


def test_from_vllm_orders_the_top_k_by_rank_whether_or_not_the_sampled_token_is_among_them():
    steps = [{7: lp(-0.1, 1), 3: lp(-2.0, 2)},                   # sampled = best (merged)
             {9: lp(-5.0, 40), 1: lp(-0.5, 1), 2: lp(-1.5, 2)},   # sampled outside the top 2
             {4: lp(-1.0, 2), 5: lp(-0.7, 1)}]                   # sampled second best
    got = from_vllm([7, 9, 4], steps, 2)
    assert got.sampled == [-0.1, -5.0, -1.0]
    assert got.top_ids == [[7, 3], [1, 2], [5, 4]]
    assert got.top == [[-0.1, -2.0], [-0.5, -1.5], [-0.7, -1.0]]
    zero = from_vllm([9], [{9: lp(-5.0, 40)}], 0)
    assert zero.sampled == [-5.0] and zero.top_ids == [[]] and zero.top == [[]]


def test_to_vllm_sampling_asks_for_them():
    pytest.importorskip("vllm")
    from omni.engines.base import SamplingParams
    from omni.engines.vllm.engine import to_vllm_sampling

    assert to_vllm_sampling(SamplingParams(logprobs=4)).logprobs == 4
    assert to_vllm_sampling(SamplingParams()).logprobs is None


def test_output_carries_them_over_the_stage_wire():
    codec_out, codec_in = m.stage_codec(), m.frontend_codec()
    out = m.Output(request_id="r", token_ids=[5, 6], logprobs=Logprobs([-0.5, -1.0], [[5, 1], [6, 2]],
                                                                       [[-0.5, -2.0], [-1.0, -3.0]]))
    back = codec_in.decode(codec_out.encode(out))
    assert back == out and back.logprobs.top_ids == [[5, 1], [6, 2]]
    assert codec_in.decode(codec_out.encode(m.Output(request_id="r", token_ids=[1]))).logprobs is None


# ---- the HTTP frontend --------------------------------------------------------------

class LogprobOrchestrator(FakeOrchestrator):
    """FakeOrchestrator's outputs with logprobs: token i gets -(i+1)/2; its top k are the token
    itself, then the next ids down by 1 each; the k-th (k >= 3) is -inf."""

    async def generate(self, request):
        k = request.sampling.logprobs
        i = 0
        async for out in super().generate(request):
            if out.token_ids and k is not None:
                t, v = out.token_ids[0], -(i + 1) / 2
                ids = [t] + [(t + j) % 300 for j in range(1, k)]
                vals = [v - j for j in range(k)]
                if k >= 3:
                    vals[-1] = -math.inf
                out.logprobs = Logprobs([v], [ids], [vals])
                i += 1
            yield out


def make(tok):
    import httpx

    orch = LogprobOrchestrator(tok, "hello world")
    app = build_app(orch, tok, served_model_name="tiny", max_model_len=128)
    return orch, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def alone(tok, t):
    return tok.decode([t], skip_special_tokens=False)


@pytest.mark.anyio
async def test_chat_logprobs_whole_and_streamed(tokenizer):
    orch, c = make(tokenizer)
    async with c:
        r = await c.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=3))
        s = await c.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=3, stream=True))
        plain = await c.post("/v1/chat/completions", json=chat_body(logprobs=True))
        off = await c.post("/v1/chat/completions", json=chat_body())
        zero = await c.post("/v1/chat/completions", json=chat_body(top_logprobs=0))   # as vLLM: no logprobs
    assert r.status_code == 200, r.text
    assert orch.requests[0].sampling.logprobs == 3 and orch.requests[2].sampling.logprobs == 0
    assert orch.requests[3].sampling.logprobs is None and orch.requests[4].sampling.logprobs is None
    assert zero.status_code == 200 and zero.json()["choices"][0]["logprobs"] is None
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [tokenizer.eos_token_id]
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [alone(tokenizer, t) for t in ids]
    assert "".join(e["token"] for e in content) == "hello world<|im_end|>"
    assert [e["logprob"] for e in content] == [-(i + 1) / 2 for i in range(len(ids))]
    for e, t in zip(content, ids):
        assert e["bytes"] == list(e["token"].encode())
        tops = e["top_logprobs"]
        assert [x["token"] for x in tops] == [alone(tokenizer, u) for u in (t, (t + 1) % 300, (t + 2) % 300)]
        assert tops[0]["logprob"] == e["logprob"] and tops[1]["logprob"] == e["logprob"] - 1
        assert tops[2]["logprob"] == -9999.0            # -inf, as OpenAI sends it
    # Streamed: each chunk carries its own tokens; together they are the whole list.
    evs = sse_events(s.text)
    chunks = [e["choices"][0] for e in evs if e["choices"]]
    assert chunks[0]["logprobs"] is None                  # the role chunk
    got = [x for ch in chunks if ch["logprobs"] for x in ch["logprobs"]["content"]]
    assert got == content
    for ch in chunks[1:]:
        if ch["delta"].get("content") and ch["logprobs"]:
            assert "".join(x["token"] for x in ch["logprobs"]["content"]) == ch["delta"]["content"]
    assert all(e["top_logprobs"] == [] for e in plain.json()["choices"][0]["logprobs"]["content"])
    assert off.json()["choices"][0]["logprobs"] is None


@pytest.mark.anyio
async def test_completion_logprobs_whole_and_streamed(tokenizer):
    orch, c = make(tokenizer)
    async with c:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "logprobs": 2})
        s = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "logprobs": 2, "stream": True})
        zero = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "logprobs": 0})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [tokenizer.eos_token_id]
    strs = [alone(tokenizer, t) for t in ids]
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == strs
    assert lp["token_logprobs"] == [-(i + 1) / 2 for i in range(len(ids))]
    assert lp["text_offset"] == [sum(len(x) for x in strs[:i]) for i in range(len(strs))]
    assert lp["top_logprobs"] == [{strs[i]: -(i + 1) / 2, alone(tokenizer, (t + 1) % 300): -(i + 1) / 2 - 1}
                                  for i, t in enumerate(ids)]
    evs = sse_events(s.text)
    parts = [e["choices"][0]["logprobs"] for e in evs if e["choices"] and e["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == strs
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]     # ascii: text = token texts
    # logprobs: 0 is the sampled token alone (OpenAI: up to logprobs + 1 entries).
    z = zero.json()["choices"][0]["logprobs"]
    assert z["top_logprobs"] == [{s: v} for s, v in zip(z["tokens"], z["token_logprobs"])]
