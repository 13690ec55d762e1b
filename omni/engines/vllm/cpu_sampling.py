"""vLLM's sampling on a CPU build made to do what it does on a GPU: two rejection-sampler kernels, and
the rewind of a seeded request's generator after a discarded (partial-prefill) sample.

A Qwen-Omni thinker with hidden-state capture runs vLLM's `extract_hidden_states` speculative
method, so every sampled token goes through vllm/v1/sample/rejection_sampler.py. Without Triton,
vLLM's CPU platform swaps its Triton kernels for C++ ones (vllm/utils/cpu_triton_utils.py), and
two of those differ from the Triton kernels:

- `expand_kernel` (temperature, top_k, top_p per token of a non-greedy batch): the shim hands the
  C++ op int64 copies of its input and of its output and never copies the output back, so the
  tensor stays as `new_empty` left it (top-k read garbage indices: the EngineCore died on the
  first sampled request); the float inputs (temperature, top_p) were truncated to integers too.
- `rejection_random_sample_kernel`: the shim rounds the float64 uniform draws to float32 before
  the C++ acceptance test, where the Triton kernel compares in float64; and with draft probabilities
  the C++ op accepts a padded draft (-1) that Triton rejects.

`install()` makes vLLM's CPU platform register these instead, in the processes that sample; the
greedy and recovered-token kernels are left to vLLM (their C++ ops write back what Triton does).

A seeded request whose sample a step discards (its prefill is not done yet) gets its generator
rewound by vLLM with `set_offset(get_offset() - 4)`, a CUDA Philox detail: a CPU generator raises
'CPU Generator does not use offset' and the Worker dies. On CPU the generator's state from before
the step's draws is put back instead (`rewind_discarded_draws`), which is what the rewind means.
"""

from __future__ import annotations

import numpy as np
import torch


def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """output[start_i:end_i] = x[i], with x[i] == replace_from read as replace_to (Triton's expand_kernel)."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[:expanded.numel()].copy_(expanded)


def rejection_random_sample_kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                   target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                                   is_greedy, max_spec_len, vocab_size, synthetic_conditional_rates=None,
                                   NO_DRAFT_PROBS=False, SYNTHETIC_MODE=False):  # noqa: N803
    """Triton's rejection_random_sample_kernel: per non-greedy request, accept drafts while
    target_prob / draft_prob (float32) >= the uniform draw (float64); the first rejected position
    takes the recovered token; all accepted, the bonus token follows."""
    if SYNTHETIC_MODE:
        raise NotImplementedError("synthetic acceptance is not supported with CPU sampling")
    n = draft_token_ids.numel()
    if n:
        ids = draft_token_ids.to(torch.int64)
        rows = torch.arange(n)
        valid = ids >= 0
        col = ids.clamp(min=0)
        target = target_probs[rows, col]
        draft = torch.ones_like(target) if NO_DRAFT_PROBS else draft_probs[rows, col]
        accepted = valid & (draft > 0) & ((target / draft).to(torch.float64) >= uniform_probs)
        accepted_l, ids_l, recovered_l = accepted.tolist(), ids.tolist(), recovered_token_ids.tolist()
    ends = cu_num_draft_tokens.tolist()
    greedy = is_greedy.tolist()
    bonus = bonus_token_ids.reshape(-1).tolist()
    start = 0
    for req, end in enumerate(ends):
        if not greedy[req]:
            row = output_token_ids[req]
            for pos in range(end - start):
                t = start + pos
                row[pos] = ids_l[t] if accepted_l[t] else recovered_l[t]
                if not accepted_l[t]:
                    break
            else:
                row[end - start] = bonus[req]
        start = end


def rewind_discarded_draws(runner_cls) -> None:
    """Patch a model runner class: snapshot the generators of the requests whose sample this step
    discards before it samples, and put those states back in place of vLLM's offset rewind."""
    if runner_cls.__dict__.get("omni_rewinds_by_state"):   # installed once per class
        return
    _require(runner_cls.__name__, [n for n in ("sample_tokens", "_bookkeeping_sync") if not hasattr(runner_cls, n)])
    sample_tokens, bookkeeping_sync = runner_cls.sample_tokens, runner_cls._bookkeeping_sync
    init = runner_cls.__init__

    def checked_init(self, *args, **kwargs):   # the attributes the patch reads are the instance's
        init(self, *args, **kwargs)
        found = {"discard_request_mask": hasattr(self, "discard_request_mask"),
                 "input_batch.generators": hasattr(getattr(self, "input_batch", None), "generators")}
        _require(runner_cls.__name__, [name for name, ok in found.items() if not ok])

    def sample(self, *args, **kwargs):
        gens = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]
        self._omni_gen_states = {int(i): gens[int(i)].get_state() for i in discarded if int(i) in gens}
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            self._omni_gen_states = {}

    def bookkeep(self, *args, **kwargs):
        gens = self.input_batch.generators
        held = {i: gens.pop(i) for i in getattr(self, "_omni_gen_states", {}) if i in gens}
        for i, gen in held.items():
            gen.set_state(self._omni_gen_states[i])
        try:   # vLLM's loop finds no generator to rewind for these
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            gens.update(held)

    runner_cls.__init__, runner_cls.sample_tokens, runner_cls._bookkeeping_sync = checked_init, sample, bookkeep
    runner_cls.omni_rewinds_by_state = True


def empty_safe_top_k(top_k_only):
    """vLLM's CPU top-k-only path (no request with top_p < 1) takes k.max(), which raises on the zero rows the
    rejection sampler passes when a step has no drafts: the Worker died (top_k with top_p 1, e.g. a request
    sending top_p 1.0 to the Qwen3-Omni deploy, whose top_k is 1). Zero rows have nothing to mask."""
    def apply_top_k_only(logits, k):
        return logits if logits.shape[0] == 0 else top_k_only(logits, k)
    apply_top_k_only.omni_empty_safe = True
    return apply_top_k_only


def _require(owner: str, missing: list[str]) -> None:
    """A vLLM that renamed what these patches replace would bring back the crash they fix, silently."""
    if missing:
        import vllm

        raise RuntimeError(f"omni's CPU sampling patch does not fit vLLM {vllm.__version__}: {owner} has no "
                           f"{', '.join(missing)} (omni/engines/vllm/cpu_sampling.py)")


def install() -> None:
    """On CPU: the runner rewinds generators by state, and where Triton is missing vLLM's platform
    registers these kernels (it does so as each Worker starts: WorkerWrapperBase). Elsewhere
    nothing changes."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    rewind_discarded_draws(CPUModelRunner)
    if not HAS_TRITON:
        from vllm.utils import cpu_triton_utils

        _require("vllm.utils.cpu_triton_utils", [n for n in ("_expand_kernel_impl", "_rejection_random_sample_kernel_impl")
                                                 if not hasattr(cpu_triton_utils, n)])
        cpu_triton_utils._expand_kernel_impl = expand_kernel
        cpu_triton_utils._rejection_random_sample_kernel_impl = rejection_random_sample_kernel
    from vllm.v1.sample.ops import topk_topp_sampler

    top_k_only = getattr(topk_topp_sampler, "apply_top_k_only", None)
    _require("vllm.v1.sample.ops.topk_topp_sampler", [] if top_k_only else ["apply_top_k_only"])
    if not getattr(top_k_only, "omni_empty_safe", False):
        topk_topp_sampler.apply_top_k_only = empty_safe_top_k(top_k_only)
