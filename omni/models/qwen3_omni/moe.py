"""The talker's sparse MoE block (routed experts + gated shared expert) without host sync.

transformers' experts loop over the experts a batch hit (`nonzero()`, one read-back per layer
on a GPU). Here every formulation keeps the routing on the device:
  grouped  rows sorted by expert and `torch._grouped_mm` with offsets computed on the device:
           only routed weights are read (the real model's 128 experts on a GPU), and on a CPU
           each expert multiplies the same rows transformers gives it, so float32 is exact.
  dense    every expert on every row, the unrouted ones weighted 0: no sort, E times the FLOPs;
           the fastest for the tiny test model (4 experts) on a CPU, but its per-expert products
           over all rows round differently from products over the routed rows (~1e-9 off at 7
           rows; exact at one row).
  gather   each (row, expert) pair gathers its expert's weights and one bmm: no sort, but the
           gathered weights grow with rows x top_k (small batches only; ~1e-9 off like dense): a
           call with many rows (a prefill: ~13.5 MiB a row at the real talker's size) loops instead.
  looped   each expert over the rows routed to it, one host read of the counts (so never in a
           captured decode): exact as grouped, memory bounded by the rows; gather's prefill.
Measured (benchmarks/qwen3_moe.py) and chosen in `default_impl`. All sum a row's top-k expert
outputs after weighting them, as transformers does; with top-2 (the tiny model) that sum is
the same in any order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

IMPLS = ("dense", "grouped", "gather")


@dataclass
class Moe:
    router: torch.Tensor          # [E, H]
    gate_up: torch.Tensor         # [E, 2I, H]
    down: torch.Tensor            # [E, H, I]
    top_k: int
    norm_topk: bool
    shared_gate_up: torch.Tensor  # [2S, H]
    shared_down: torch.Tensor     # [H, S]
    shared_gate: torch.Tensor     # [1, H]
    impl: str = "grouped"

    @classmethod
    def from_block(cls, block, impl: str) -> "Moe":
        """From transformers' Qwen3OmniMoeTalkerTextSparseMoeBlock (weights shared, the shared
        expert's gate and up projections stacked into one)."""
        se = block.shared_expert
        return cls(block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, block.gate.top_k,
                   bool(block.gate.norm_topk_prob), torch.cat([se.gate_proj.weight, se.up_proj.weight]),
                   se.down_proj.weight, block.shared_expert_gate.weight, impl)

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def __call__(self, x: torch.Tensor, many: bool = False) -> torch.Tensor:
        """x [N, H] -> [N, H]; `many`: a prefill's rows, which gather would copy weights for pair by pair."""
        weights, experts = self.route(x)
        impl = "looped" if many and self.impl == "gather" else self.impl
        return getattr(self, "_" + impl)(x, weights, experts) + self.shared_out(x)

    def shared_out(self, x: torch.Tensor) -> torch.Tensor:
        """The gated shared expert."""
        return torch.sigmoid(F.linear(x, self.shared_gate)) * gated_mlp(x, self.shared_gate_up, self.shared_down)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' top-k router: softmax in float32, top k, optionally renormalised."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), idx

    def _dense(self, x, weights, experts):
        n, h = x.shape
        e = self.num_experts
        gu = F.linear(x, self.gate_up.view(-1, h)).view(n, e, -1)          # [N, E, 2I]
        gate, up = gu.chunk(2, dim=-1)
        act = (F.silu(gate) * up).transpose(0, 1)                           # [E, N, I]
        out = torch.bmm(act, self.down.transpose(1, 2))                     # [E, N, H]
        w = torch.zeros((n, e), dtype=x.dtype, device=x.device).scatter_(1, experts, weights)
        return (out * w.t()[:, :, None]).sum(0)

    def _gather(self, x, weights, experts):
        n, h = x.shape
        flat = experts.reshape(-1)                                          # [N*k]
        rows = x.repeat_interleave(self.top_k, dim=0, output_size=n * self.top_k)[:, None]
        gu = torch.bmm(rows, self.gate_up[flat].transpose(1, 2))            # [N*k, 1, 2I]
        gate, up = gu.chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.down[flat].transpose(1, 2))[:, 0]
        return (out * weights.reshape(-1, 1)).view(n, self.top_k, h).sum(1)

    def _looped(self, x, weights, experts):
        n, h = x.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[order // self.top_k]
        out = torch.empty_like(rows)
        start = 0
        for e, c in enumerate(counts):
            if c:
                out[start:start + c] = gated_mlp(rows[start:start + c], self.gate_up[e], self.down[e])
            start += c
        pairs = torch.empty_like(out).index_copy_(0, order, out)               # back to (row, k) order
        return (pairs * weights.reshape(-1, 1)).view(n, self.top_k, h).sum(1)

    def _grouped(self, x, weights, experts):
        n, h = x.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = x[order // self.top_k]
        gu = torch._grouped_mm(rows, self.gate_up.transpose(1, 2), offs=offs)   # [N*k, 2I]
        gate, up = gu.chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=offs)
        pairs = torch.empty_like(out).index_copy_(0, order, out)               # back to (row, k) order
        return (pairs * weights.reshape(-1, 1)).view(n, self.top_k, h).sum(1)


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up stacked [2I, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def default_impl(device: torch.device, dtype: torch.dtype, num_experts: int) -> str:
    """grouped where `torch._grouped_mm` runs: a CPU (any dtype), a GPU in bfloat16 (its kernel's
    dtype); else dense for few experts, gather for many."""
    if hasattr(torch, "_grouped_mm") and (device.type == "cpu" or dtype == torch.bfloat16):
        return "grouped"
    return _ungrouped(num_experts)


def _ungrouped(num_experts: int) -> str:
    return "dense" if num_experts <= 16 else "gather"


def probed_impl(block, device: torch.device, dtype: torch.dtype) -> str:
    """The default impl, checked once on this device: `torch._grouped_mm`'s GPU kernel has layout and
    alignment rules that vary by GPU and torch version, so on CUDA grouped runs a few rows beside the
    ungrouped formulation first; if it raises, reads device values back (a sync a CUDA graph cannot hold)
    or disagrees, the talker keeps running on that one (logged)."""
    experts = block.experts.gate_up_proj.shape[0]
    impl = default_impl(device, dtype, experts)
    if impl != "grouped" or device.type != "cuda":
        return impl
    fallback = _ungrouped(experts)
    x = torch.randn(7, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(device, dtype)
    try:
        got = _without_host_reads(lambda: Moe.from_block(block, "grouped")(x)).float().cpu()
        want = Moe.from_block(block, fallback)(x).float().cpu()
    except RuntimeError as e:
        logger.warning("talker MoE: torch._grouped_mm failed on this device (%s); using %s", e, fallback)
        return fallback
    if not torch.allclose(got, want, rtol=0.05, atol=0.05 * want.abs().max().item()):
        logger.warning("talker MoE: torch._grouped_mm disagrees with %s here (max diff %.3g); using %s",
                       fallback, (got - want).abs().max().item(), fallback)
        return fallback
    return impl


def _without_host_reads(fn):
    """fn() with any device-to-host sync an error: where the grouped GEMM has no fast kernel (GPUs
    other than sm90/sm100 in torch 2.10), its fallback reads the offsets back, which works eagerly
    but cannot be captured in a CUDA graph and stalls every MoE layer of every frame."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
