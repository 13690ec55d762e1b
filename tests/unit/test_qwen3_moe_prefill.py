"""The talker MoE's prefill path and a prefill that runs out of device memory (tiny Qwen3-Omni, CPU): a
prefill never takes gather (which copies each routed expert's weights per row), and an out-of-memory
prefill is that request's error."""

from __future__ import annotations

import pytest
import torch

from tests.unit.qwen3_ref import drive
from tests.unit.test_qwen3_talker import folder  # noqa: F401 (the tiny model, shared)

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")


@pytest.fixture(scope="module")
def engine(folder):
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    return Qwen3TalkerEngine(folder, moe_impl="gather", max_num_seqs=2)


def _spy(monkeypatch):
    from omni.models.qwen3_omni.moe import Moe

    calls = []
    for impl in ("gather", "looped"):
        real = getattr(Moe, "_" + impl)
        monkeypatch.setattr(Moe, "_" + impl, lambda self, x, *a, _r=real, _i=impl: calls.append((_i, x.shape[0]))
                            or _r(self, x, *a))
    return calls


def test_looped_equals_transformers_and_gather(engine):
    """The per-expert loop = transformers' experts loop exactly (each expert multiplies the rows it is given)."""
    from omni.models.qwen3_omni.moe import Moe

    block = engine.talker.model.layers[0].mlp
    x = torch.randn(23, block.gate.hidden_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x[None])[0]
        assert torch.equal(Moe.from_block(block, "gather")(x, many=True), want)
        assert torch.allclose(Moe.from_block(block, "gather")(x), want, rtol=0, atol=1e-8)


def test_a_prefill_never_gathers_a_decode_does(engine, monkeypatch, folder):
    """moe_impl gather (CUDA without bf16 grouped GEMM): the prefill's rows loop over the experts (gather there
    took ~13.5 MiB a row at the real size, 27 GB for a 2,000-row prompt), the decode batch still gathers."""
    from transformers import AutoTokenizer

    from omni.engines.base import EngineRequest, SamplingParams

    calls = _spy(monkeypatch)
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea. " * 20}],
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    r = EngineRequest(request_id="a", prompt_token_ids=prompt, generated_ids=[100, 200, tok.convert_tokens_to_ids("<|im_end|>")],
                      final=True, sampling=SamplingParams(max_tokens=4))
    drive(engine, {"a": [r]})
    prefill = {impl for impl, rows in calls if rows > 2}
    decode = {impl for impl, rows in calls if rows <= 2}
    assert prefill == {"looped"} and decode == {"gather"}, calls
    assert max(rows for _, rows in calls) > len(prompt)


def _hi(folder):
    """rid -> a short request whose thinker has finished (two text ids)."""
    from transformers import AutoTokenizer

    from omni.engines.base import EngineRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    return lambda rid: EngineRequest(request_id=rid, prompt_token_ids=prompt, generated_ids=[100, 200], final=True,
                                     sampling=SamplingParams(max_tokens=4))


def test_an_out_of_memory_prefill_is_that_requests_error(engine, monkeypatch, folder):
    """torch.OutOfMemoryError (a RuntimeError, not the ValueError the prefill took) escaped step(); now the
    request ends with an error naming it, its slot is free and the next request runs."""
    req = _hi(folder)
    real = engine._static.dev.backbone.prefill

    def oom(x, slot):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 27.00 GiB")

    monkeypatch.setattr(engine._static.dev.backbone, "prefill", oom)
    out = drive(engine, {"big": [req("big")]})["big"]
    assert out[-1].finish_reason == "error" and "out of device memory in the talker prefill" in out[-1].error
    assert engine._static.owner == [] and not engine.has_open_streams()
    monkeypatch.setattr(engine._static.dev.backbone, "prefill", real)
    assert drive(engine, {"next": [req("next")]})["next"][-1].finish_reason == "length"


def test_an_out_of_memory_prefill_on_the_eager_path_is_that_requests_error(folder, monkeypatch):  # noqa: F811
    """static_decode: false had no such guard: the error escaped step() and took the stage's loop down."""
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    engine = Qwen3TalkerEngine(folder, static_decode=False, max_num_seqs=2)
    req = _hi(folder)
    model = engine.talker.model
    real = type(model).forward

    def oom(self, *a, **kw):
        if kw.get("inputs_embeds") is not None and kw["inputs_embeds"].shape[1] > 1:   # a prefill
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 27.00 GiB")
        return real(self, *a, **kw)

    monkeypatch.setattr(type(model), "forward", oom)
    out = drive(engine, {"big": [req("big")]})["big"]
    assert out[-1].finish_reason == "error" and "out of device memory in the talker prefill" in out[-1].error
    monkeypatch.setattr(type(model), "forward", real)
    assert drive(engine, {"next": [req("next")]})["next"][-1].finish_reason == "length"
