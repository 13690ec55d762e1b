"""Issue 15, item 3: logprobs / top_logprobs through `omni serve` on the default torch pipeline,
with the official `openai` client, against log_softmax of HF transformers' logits in float32
(greedy: the sampled token is the argmax). The vLLM stage's are checked in test_vllm_stage.py."""

from __future__ import annotations

import json

import pytest

from tests.e2e.harness import OmniProcess, omni_shm_entries

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
N, K = 12, 5
TOL = 2e-3     # float32 both sides; the engine's batched forward is not HF's op for op


@pytest.fixture(scope="module")
def server():
    p = OmniProcess("serve", MODEL, "--port", "0", "--stage-overrides", json.dumps({"0": {"dtype": "float32"}}))
    try:
        yield p.http(300)
    finally:
        # Ctrl-C, then the whole tree gone: the stages go with the launcher, and its temp dir and shm
        assert omni_shm_entries(p.stop(60)) == []


@pytest.fixture(scope="module")
def hf():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omni.models.resolve import resolve_model

    torch.set_num_threads(1)
    path = resolve_model(MODEL)
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy_reference(hf, prompt: list[int]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token text alone, its logprob, the top K as (text, logprob)) per greedy step, to EOS or N."""
    import torch

    tok, model = hf
    eos = {tok.eos_token_id, *([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])}
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(N):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            vals, top = torch.topk(lp, K)
            t = int(top[0])
            alone = [tok.decode([i], skip_special_tokens=False) for i in top.tolist()]
            out.append((alone[0], float(vals[0]), list(zip(alone, vals.tolist()))))
            ids.append(t)
            if t in eos:
                break
    return out


def chat_prompt(hf) -> list[int]:
    ids = hf[0].apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def assert_matches(got: list[tuple[str, float, list[tuple[str, float]]]], ref) -> None:
    assert [g[0] for g in got] == [r[0] for r in ref]
    for (_, lp, top), (_, rlp, rtop) in zip(got, ref):
        assert lp == pytest.approx(rlp, abs=TOL)
        assert [v for _, v in top] == pytest.approx([v for _, v in rtop], abs=TOL)
        # Token by token where the reference's neighbours are not a near tie.
        for i, (s, _) in enumerate(top):
            gaps = [abs(rtop[i][1] - rtop[j][1]) for j in (i - 1, i + 1) if 0 <= j < len(rtop)]
            if min(gaps) > 2 * TOL:
                assert s == rtop[i][0]


def test_chat_logprobs_match_transformers(server, hf):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=120)
    ref = greedy_reference(hf, chat_prompt(hf))
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=N, temperature=0,
                                       logprobs=True, top_logprobs=K)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(ref)
    assert_matches([(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content], ref)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert "Paris" in r.choices[0].message.content
    # Streamed: the chunks' entries, in order, are the same list.
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=N, temperature=0,
                                            logprobs=True, top_logprobs=K, stream=True)
    got = [c for ch in stream if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert_matches([(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in got], ref)


def test_completion_logprobs_match_transformers(server, hf):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=120)
    prompt = "The capital of France is"
    ref = greedy_reference(hf, hf[0].encode(prompt))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, logprobs=K)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == len(ref)
    # The sampled token is the best under greedy, so each map holds exactly the top K.
    assert_matches([(t, v, sorted(top.items(), key=lambda kv: -kv[1]))
                    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)], ref)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, logprobs=K,
                                       stream=True)
    parts = [ch.choices[0].logprobs for ch in stream if ch.choices and ch.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs


def test_out_of_range_is_a_400_naming_the_parameter(server):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=21)
    assert e.value.body["param"] == "logprobs"
