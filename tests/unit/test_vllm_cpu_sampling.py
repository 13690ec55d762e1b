"""omni/engines/vllm/cpu_sampling.py: vLLM's rejection-sampler kernels and seeded rewind on CPU, as on a GPU.
The served check (a sampled thinker with capture on) is tests/e2e/test_vllm_qwen3_omni.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.engines.vllm import cpu_sampling


def test_expand_fills_every_dtype_with_the_replacement():
    cu = torch.tensor([1, 3, 3, 4], dtype=torch.int32)   # the third request has no tokens
    temp = torch.tensor([0.4, 0.0, 0.7, 0.9])
    out = temp.new_empty(4)
    cpu_sampling.expand_kernel(out, temp, cu, 0, 1, 128)
    assert out.tolist() == pytest.approx([0.4, 1.0, 1.0, 0.9])   # greedy rows divide by 1
    top_k = torch.tensor([1, 50, 3, 7], dtype=torch.int32)
    out = top_k.new_empty(4)
    cpu_sampling.expand_kernel(out, top_k, cu, 0, 0, 128)
    assert out.tolist() == [1, 50, 50, 7]


def _random(draft_ids, target, uniform, *, draft_probs=None, is_greedy=(False,), bonus=9, recovered=None):
    n = len(draft_ids)
    out = torch.full((len(is_greedy), n + 1), -1, dtype=torch.int32)
    cpu_sampling.rejection_random_sample_kernel(
        out, torch.tensor([n] * len(is_greedy), dtype=torch.int32), torch.tensor(draft_ids, dtype=torch.int32),
        draft_probs, target, torch.tensor([[bonus]] * len(is_greedy)),
        torch.tensor(recovered or [5] * n, dtype=torch.int32), torch.tensor(uniform, dtype=torch.float64),
        torch.tensor(is_greedy), n, target.shape[1], None, draft_probs is None, False)
    return out.tolist()


def test_random_acceptance_compares_in_float64_as_triton_does():
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    # 0.5 >= 0.5 + 1e-12 is false in float64; vLLM's C++ fallback rounded the draw to 0.5 and accepted.
    assert _random([2], target, [0.5 + 1e-12], recovered=[1]) == [[1, -1]]
    assert _random([2], target, [0.5 - 1e-12]) == [[2, 9]]   # accepted: the bonus follows


def test_random_rejects_padded_drafts_and_leaves_greedy_rows():
    target = torch.full((2, 4), 0.25)
    draft = torch.full((2, 4), 0.25)
    assert _random([-1, 2], target, [0.0, 0.0], draft_probs=draft, recovered=[3, 1]) == [[3, -1, -1]]
    assert _random([1, 2], target, [0.1, 0.1], draft_probs=draft) == [[1, 2, 9]]
    assert _random([1], target[:1], [0.1], is_greedy=(True,)) == [[-1, -1]]


class _Runner:
    """vLLM's GPUModelRunner as far as the rewind goes: sample draws, bookkeeping rewinds by offset."""

    def __init__(self, discard):
        self.input_batch = type("B", (), {})()
        self.input_batch.num_reqs = len(discard)
        self.input_batch.generators = {i: torch.Generator().manual_seed(i) for i in range(len(discard))}
        self.discard_request_mask = type("M", (), {"np": np.array(discard)})()

    def sample_tokens(self, grammar_output):
        for g in self.input_batch.generators.values():
            torch.rand(3, generator=g)
        return self._bookkeeping_sync()

    def _bookkeeping_sync(self):
        for i in np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)   # a CPU generator raises here
        return "out"


def test_a_discarded_sample_leaves_its_generator_as_before(monkeypatch):
    with pytest.raises(RuntimeError, match="does not use offset"):
        _Runner([False, True]).sample_tokens(None)
    cls = type("Patched", (_Runner,), {})
    cpu_sampling.rewind_discarded_draws(cls)
    r = cls([False, True])
    before = {i: g.get_state() for i, g in r.input_batch.generators.items()}
    assert r.sample_tokens(None) == "out"
    gens = r.input_batch.generators
    assert sorted(gens) == [0, 1]
    assert torch.equal(gens[1].get_state(), before[1])       # as if it never drew
    assert not torch.equal(gens[0].get_state(), before[0])   # a kept sample's draw stays


def test_a_vllm_without_what_the_patches_replace_fails_at_start(monkeypatch):
    import vllm
    from vllm.utils import cpu_triton_utils

    rewind = cpu_sampling.rewind_discarded_draws
    with monkeypatch.context() as m:   # the real CPUModelRunner stays as it is
        m.setattr(cpu_sampling, "rewind_discarded_draws", lambda cls: None)
        m.delattr(cpu_triton_utils, "_expand_kernel_impl")
        with pytest.raises(RuntimeError, match=rf"vLLM {vllm.__version__}: .*no _expand_kernel_impl"):
            cpu_sampling.install()
    assert cpu_sampling.rewind_discarded_draws is rewind
    with pytest.raises(RuntimeError, match="Renamed has no _bookkeeping_sync"):
        cpu_sampling.rewind_discarded_draws(type("Renamed", (), {"sample_tokens": _Runner.sample_tokens}))

    class Moved(_Runner):
        def __init__(self):
            super().__init__([False])
            del self.discard_request_mask
    cpu_sampling.rewind_discarded_draws(Moved)
    with pytest.raises(RuntimeError, match="Moved has no discard_request_mask"):
        Moved()


def test_top_k_alone_on_the_rejection_samplers_zero_rows_is_a_no_op(monkeypatch):
    """A step without drafts hands the rejection sampler's constraints zero rows; with top_k and no top_p < 1
    vLLM's CPU path took k.max() of nothing and the Worker died (a Qwen-Omni thinker with capture on)."""
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    empty, no_k = torch.empty(0, 100), torch.empty(0, dtype=torch.int32)
    original = tts.apply_top_k_only
    with monkeypatch.context() as m:   # vLLM's modules as they were after the test
        m.setattr(cpu_sampling, "rewind_discarded_draws", lambda cls: None)
        m.setattr(tts, "apply_top_k_only", original)
        for name in ("_expand_kernel_impl", "_rejection_random_sample_kernel_impl"):
            m.setattr(cpu_triton_utils, name, getattr(cpu_triton_utils, name))
        if not getattr(original, "omni_empty_safe", False):
            with pytest.raises(RuntimeError):
                tts.apply_top_k_top_p_pytorch(empty, no_k, None, allow_cpu_sync=True)
        cpu_sampling.install()
        cpu_sampling.install()   # once is enough: not wrapped twice
        assert tts.apply_top_k_top_p_pytorch(empty, no_k, None, allow_cpu_sync=True).shape == (0, 100)
        logits, k = torch.randn(3, 100, generator=torch.Generator().manual_seed(0)), torch.tensor([1, 5, 100])
        assert torch.equal(tts.apply_top_k_top_p_pytorch(logits.clone(), k.clone(), None, allow_cpu_sync=True),
                           original(logits.clone(), k.clone()))
