"""Sampling parameters users rely on (issue 15, item 3): penalties, logit_bias and min_tokens in the
torch engine (checked against HF transformers where it has them, else by hand), their mapping onto
vLLM's SamplingParams, and a 400 naming each parameter omni does not do yet or gets out of range
(logprobs' among them)."""

from __future__ import annotations

import pytest
import torch

from omni.engines.base import SamplingOverrides, SamplingParams
from omni.engines.torch_lm_sampling import shape_logits
from tests.unit.api_fakes import assert_error, chat_body, make, tokenizer  # noqa: F401 (fixture)
from tests.unit.test_torch_lm import EOS, PROMPTS, engine, req, run, tiny, tokens  # noqa: F401 (fixtures)


def hf_generate(model, prompt, n, **kw):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, eos_token_id=EOS, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_and_min_tokens_match_hf(engine, tiny):
    _, model = tiny
    n = 16
    outs, _ = run(engine, {0: [req("rp", PROMPTS["b"], max_tokens=n, repetition_penalty=1.8),
                               req("plain", PROMPTS["b"], max_tokens=n)]})
    assert tokens(outs["rp"]) == hf_generate(model, PROMPTS["b"], n, repetition_penalty=1.8)
    assert tokens(outs["rp"]) != tokens(outs["plain"])      # it changed something
    # min_tokens: EOS is banned until then (biased up so that it would come at once otherwise).
    outs, _ = run(engine, {0: [req("eos", PROMPTS["a"], max_tokens=n, logit_bias={EOS: 50.0}),
                               req("min", PROMPTS["a"], max_tokens=n, logit_bias={EOS: 50.0}, min_tokens=5)]})
    assert tokens(outs["eos"]) == [EOS]
    got = tokens(outs["min"])
    assert len(got) == 6 and got[-1] == EOS and EOS not in got[:5]
    assert outs["min"][-1].finish_reason == "stop"


def test_logit_bias_forces_a_token(engine):
    outs, _ = run(engine, {0: [req("lb", PROMPTS["c"], max_tokens=5, logit_bias={42: 100.0})]})
    assert tokens(outs["lb"]) == [42] * 5


def test_presence_and_frequency_penalties_by_hand():
    row = torch.zeros(8)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    shape_logits(row, p, prompt=[1, 2], output=[3, 3, 4], eos_ids=frozenset())
    assert row.tolist() == [0, 0, 0, -1.0, -0.75, 0, 0, 0]    # prompt tokens untouched


def test_vllm_sampling_params_get_them():
    pytest.importorskip("vllm")
    from omni.engines.vllm.engine import to_vllm_sampling

    v = to_vllm_sampling(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                                        logit_bias={7: 3.0}, min_tokens=2, max_tokens=8))
    assert (v.presence_penalty, v.frequency_penalty, v.repetition_penalty, v.min_tokens) == (0.5, 0.25, 1.1, 2)
    assert v.logit_bias == {7: 3.0}


@pytest.mark.anyio
@pytest.mark.parametrize("route, extra, param", [
    ("chat", {"top_logprobs": 2}, "top_logprobs"),             # without logprobs: true
    ("chat", {"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),                    # chat's is a boolean
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"presence_penalty": 3.0}, "presence_penalty"),
    ("chat", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("chat", {"min_tokens": -1}, "min_tokens"),
    ("cmpl", {"echo": True}, "echo"),
    ("cmpl", {"best_of": 2}, "best_of"),
    ("cmpl", {"suffix": "end"}, "suffix"),
    ("cmpl", {"logprobs": 21}, "logprobs"),
    ("cmpl", {"logprobs": -1}, "logprobs"),
    ("cmpl", {"logprobs": True}, "logprobs"),                 # completions' is a count
])
async def test_unsupported_or_bad_parameters_are_a_400_naming_them(tokenizer, route, extra, param):
    _, client = make(tokenizer)
    async with client:
        if route == "chat":
            r = await client.post("/v1/chat/completions", json=chat_body(**extra))
        else:
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **extra})
    assert_error(r, 400, param=param)


@pytest.mark.anyio
async def test_supported_parameters_reach_the_engine(tokenizer):
    orch, client = make(tokenizer)
    async with client:
        r = await client.post("/v1/chat/completions", json=chat_body(
            presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1, logit_bias={"7": 3},
            min_tokens=2, max_tokens=8, response_format={"type": "text"}, tool_choice="none", logprobs=False))
    assert r.status_code == 200, r.text
    s = orch.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens) == (0.5, 0.25, 1.1, 2)
    assert s.logit_bias == {7: 3.0}


@pytest.mark.anyio
async def test_min_tokens_above_max_tokens_is_capped_by_it(tokenizer):
    """A cross-field rule no schema states (issue 15, item 5): max_tokens ends the completion first."""
    orch, client = make(tokenizer)
    async with client:
        r = await client.post("/v1/chat/completions", json=chat_body(min_tokens=50, max_tokens=4))
    assert r.status_code == 200, r.text
    assert (orch.requests[-1].sampling.min_tokens, orch.requests[-1].sampling.max_tokens) == (4, 4)


@pytest.mark.anyio
async def test_version_and_ping(tokenizer):
    import omni

    orch, client = make(tokenizer)
    async with client:
        v = await client.get("/version")
        ping = await client.get("/ping")
        ping_post = await client.post("/ping")
        orch.ok, orch.reason = False, "down"
        sick = await client.get("/ping")
    assert v.status_code == 200 and v.json() == {"version": omni.version()} and omni.version()[0].isdigit()
    assert ping.status_code == 200 and ping_post.status_code == 200
    assert sick.status_code == 503


@pytest.mark.anyio
async def test_metrics_have_vllm_token_counters_and_latencies(tokenizer):
    _, client = make(tokenizer)
    async with client:
        r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=8))
        usage = r.json()["usage"]
        text = (await client.get("/metrics")).text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    labels = '{model_name="tiny",frontend="0"}'
    assert int(lines["vllm:prompt_tokens_total" + labels]) == usage["prompt_tokens"] > 0
    assert int(lines["vllm:generation_tokens_total" + labels]) == usage["completion_tokens"] > 0
    assert int(lines["vllm:time_to_first_token_seconds_count" + labels]) == 1
    assert int(lines["vllm:e2e_request_latency_seconds_count" + labels]) == 1


def test_metrics_of_several_frontends_merge_by_family():
    from omni.api.metrics import FrontendMetrics
    from omni.api.metrics_merge import merge

    texts = []
    for i in range(2):
        m = FrontendMetrics(i, "tiny")
        m.started()
        m.finished("/v1/chat/completions", 200, 0.5)
        m.tokens(10 + i, 3)
        texts.append(m.render())
    merged = merge(texts)
    assert merged.count("# TYPE vllm:prompt_tokens_total counter") == 1
    assert 'vllm:prompt_tokens_total{model_name="tiny",frontend="0"} 10' in merged
    assert 'vllm:prompt_tokens_total{model_name="tiny",frontend="1"} 11' in merged
    lines = merged.splitlines()
    at = lines.index("# TYPE vllm:e2e_request_latency_seconds histogram")
    family = lines[at + 1:at + 1 + 2 * (len(m.e2e.buckets) + 3)]
    assert all(x.startswith("vllm:e2e_request_latency_seconds_") for x in family)   # both frontends' samples


@pytest.mark.anyio
async def test_the_prompt_stage_defaults_sit_under_the_clients_own_values(tokenizer):
    """A deploy's thinker `default_sampling_params` (Qwen3-Omni: temperature 0.4, top_p 0.9, top_k 1)
    reach the request where the client left a value out; the client's own win (vLLM's way with
    a generation config's defaults)."""
    defaults = SamplingOverrides(temperature=0.4, top_p=0.9, top_k=1, repetition_penalty=1.1, seed=42)
    orch, c = make(tokenizer, sampling_defaults=defaults)
    assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
    assert (await c.post("/v1/chat/completions", json=chat_body(temperature=0, top_p=0.5, top_k=7, seed=3,
                                                                repetition_penalty=1.0))).status_code == 200
    fill, own = orch.requests[0].sampling, orch.requests[1].sampling
    assert (fill.temperature, fill.top_p, fill.top_k, fill.repetition_penalty, fill.seed) == (0.4, 0.9, 1, 1.1, 42)
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty, own.seed) == (0.0, 0.5, 7, 1.0, 3)
    orch, c = make(tokenizer)       # no defaults: vLLM's (temperature 1, the rest off)
    assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
    p = orch.requests[0].sampling
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.seed) == (1.0, 1.0, 0, 1.0, None)


def test_overrides_replace_only_what_the_stage_sets():
    base = SamplingParams(max_tokens=9, temperature=0.2, seed=5, top_k=3)
    got = SamplingOverrides(temperature=0.9, max_tokens=100, noise_scale=0.0).over(base)
    assert (got.temperature, got.max_tokens, got.seed, got.top_k) == (0.9, 100, 5, 3)
    assert SamplingOverrides().over(base) is base


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, repetition_penalty=5e-324),
                                    SamplingParams(temperature=5e-324),
                                    SamplingParams(temperature=1.0, repetition_penalty=5e-324, top_k=3, top_p=0.5),
                                    SamplingParams(temperature=1.0, top_p=5e-324)],
                         ids=["penalty", "temperature", "penalty-top-k-p", "top-p"])
def test_a_tiny_temperature_penalty_or_top_p_samples_a_top_token_not_nan(params):
    """Found by Schemathesis: repetition_penalty 5e-324 (valid: > 0) overflowed the logits to inf, the
    softmax gave NaN and torch.multinomial failed the engine step (a 500, and the step of every request
    batched with it); top_p 5e-324 is 0 in float32 and dropped every token."""
    from omni.engines.torch_lm_sampling import sample

    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0, 0.5]])
    got = sample(logits, [params], [torch.Generator().manual_seed(0)], history=[([1, 2], [4])])
    # a tiny temperature: the top token; a tiny penalty: one of the seen tokens it pushed to the top
    assert got == [1] if params.repetition_penalty == 1.0 else got[0] in (1, 2)
