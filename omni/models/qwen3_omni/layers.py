"""The talkers' decoder stacks as plain functions over transformers' weights, reading and writing a
preallocated KV cache (the static decode step's forward).

The maths of transformers' Qwen3OmniMoeTalkerModel / Qwen3OmniMoeTalkerCodePredictorModel and
Qwen2_5OmniTalkerModel: pre-norm decoder layers (RMSNorm in float32), q/k RMSNorm per head (Qwen3)
or q/k/v biases (Qwen2.5), rotary embeddings (the multimodal rope reduces to plain rope: its three
position rows are equal for audio and text), grouped-query attention, then the sparse MoE (Qwen3
talker) or a gated MLP. Each layer's q/k/v projections are stacked into one matrix and q and k are
normalised and rotated together, so a layer is a few large ops rather than many small ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omni.models.qwen3_omni.moe import Moe, gated_mlp


def scalar(value: float, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


class Norm:
    """transformers' Qwen RMSNorm over x's last dimension: normalise in float32, scale in x's dtype.

    On a CPU as transformers writes it, with eps and the width as float32 0-dim tensors (an in-place
    op with a Python number converts the number every call, and this runs ~300 times a frame): equal
    to transformers bit for bit. On CUDA torch's fused kernel (`F.rms_norm`) normalises and the weight
    follows in x's dtype, as transformers applies it: two launches instead of six to eight, the same
    roundings, the reduction in another order. Unfused, norms were ~40% of a Qwen3 frame's kernels."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, float(eps)
        self._eps, self._width = scalar(eps, weight.device), scalar(weight.shape[-1], weight.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            y = F.rms_norm(x, (x.shape[-1],), None, self.eps)
            return y.mul_(self.weight) if x.dtype == torch.float32 else self.weight * y
        xf = x.float()
        r = torch.addcdiv(self._eps, xf.square().sum(-1, keepdim=True), self._width).rsqrt_()   # rsqrt(mean + eps)
        if x.dtype == torch.float32:
            return (xf * r).mul_(self.weight)
        return self.weight * (xf * r).to(x.dtype)


def rope_tables(inv_freq: torch.Tensor, scaling: float, length: int, dtype, device):
    """(cos, signed sin) [length, head_dim] for positions 0..length-1, computed as transformers does;
    the sin's first half is negated so rotate_half becomes a swap of halves (`rope`)."""
    pos = torch.arange(length, dtype=torch.float, device=device)
    freqs = pos[:, None] * inv_freq.to(device=device, dtype=torch.float)[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.to(dtype), sin.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with `sin` from rope_tables (same floats as transformers)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


@dataclass
class Layer:
    ln1: Norm
    ln2: Norm
    qkv: torch.Tensor             # [(nh + 2 kv) * hd, H]
    qkv_bias: torch.Tensor | None
    qk_norm: Norm | None          # over [nh + kv, hd]: q_norm's weight per query head, then k_norm's (Qwen3)
    o: torch.Tensor
    mlp: Moe | tuple[torch.Tensor, torch.Tensor]     # the MoE, or a gated MLP's (gate_up, down)

    @classmethod
    def from_module(cls, layer, mlp) -> "Layer":
        a = layer.self_attn
        nh = a.q_proj.weight.shape[0] // a.head_dim
        kv = a.k_proj.weight.shape[0] // a.head_dim
        qk = None
        if hasattr(a, "q_norm"):
            qk = Norm(torch.cat([a.q_norm.weight.expand(nh, -1), a.k_norm.weight.expand(kv, -1)]),
                      a.q_norm.variance_epsilon)
        projs = (a.q_proj, a.k_proj, a.v_proj)
        bias = torch.cat([p.bias for p in projs]) if a.q_proj.bias is not None else None
        ln1, ln2 = (Norm(n.weight, n.variance_epsilon) for n in (layer.input_layernorm, layer.post_attention_layernorm))
        return cls(ln1, ln2, torch.cat([p.weight for p in projs]), bias, qk, a.o_proj.weight, mlp)

    def feed_forward(self, x: torch.Tensor, many: bool = False) -> torch.Tensor:
        """x [R, H] -> x + mlp(norm(x)); `many`: a prefill's rows (Moe.__call__)."""
        h = self.ln2(x)
        if isinstance(self.mlp, Moe):
            return x + self.mlp(h, many)
        return x + gated_mlp(h, *self.mlp)


class Stack:
    """One decoder stack and its KV cache [slots, kv_heads, length, head_dim] per layer.

    Rows go through the projections as 2-D [rows, H] tensors (a 3-D linear costs several times
    a 2-D one on a CPU at these sizes); only attention sees heads."""

    def __init__(self, layers: list[Layer], norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
                 head_dim: int, rotary, slots: int, length: int):
        self.layers, self.norm = layers, Norm(norm, eps)
        self.nh, self.kv, self.hd = heads, kv_heads, head_dim
        w = norm
        self.cos, self.sin = rope_tables(rotary.inv_freq, rotary.attention_scaling, length, w.dtype, w.device)
        shape = (slots, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in layers]
        self.v = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in layers]
        self.length = length
        self._rows = torch.arange(slots, device=w.device)[:, None]
        self._heads = torch.arange(kv_heads, device=w.device)[None, :]
        self._at: dict[int, tuple] = {}

    def _qkv(self, layer: Layer, x: torch.Tensor, cos, sin):
        """x [R, H] -> q [R, nh, hd], k and v [R, kv, hd] (normed, rotated)."""
        h = layer.ln1(x)
        qkv = F.linear(h, layer.qkv, layer.qkv_bias).view(x.shape[0], -1, self.hd)
        qk, v = qkv.split([self.nh + self.kv, self.kv], dim=1)
        if layer.qk_norm is not None:
            qk = layer.qk_norm(qk)
        q, k = rope(qk, cos, sin).split([self.nh, self.kv], dim=1)
        return q, k, v

    def _out(self, layer: Layer, x: torch.Tensor, attn: torch.Tensor, many: bool = False) -> torch.Tensor:
        """Residual + o_proj of the attention rows attn [R, nh * hd], then the feed-forward."""
        return layer.feed_forward(x + F.linear(attn, layer.o), many)

    def prefill(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """One request's first rows x [T, H] into `slot` (positions 0..T-1) -> the normed hidden [T, H]."""
        t = x.shape[0]
        cos, sin = self.cos[:t, None], self.sin[:t, None]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            self.k[i][slot, :, :t] = k[0]
            self.v[i][slot, :, :t] = v[0]
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
            x = self._out(layer, x, attn[0].transpose(0, 1).reshape(t, -1), many=True)
        return self.norm(x)

    def decode(self, x: torch.Tensor, pos: torch.Tensor, width: int, mask: torch.Tensor | None) -> torch.Tensor:
        """One row per slot 0..B-1: x [B, H] at positions pos [B] (device) -> the normed hidden [B, H].

        Attention reads the first `width` cached positions of each slot; `mask` [B, 1, 1, width]
        bool (None: every slot attends all `width`, i.e. all are at position width - 1)."""
        b = x.shape[0]
        # A full slot that waits for text still rides along in the batch (its row is not used):
        # its position is kept in bounds for the rotary tables and the cache write.
        pos = pos.clamp(max=self.length - 1)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        at = (self._rows[:b], self._heads, pos[:, None])
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self.k[i].index_put_(at, k)
            self.v[i].index_put_(at, v)
            # the query heads that share a KV head as that head's query rows: plain attention over the
            # cache as stored (no GQA support needed, so CUDA's masked kernels serve it without copying
            # k and v per query head); the same products and sums per head
            attn = F.scaled_dot_product_attention(q.view(b, self.kv, -1, self.hd), self.k[i][:b, :, :width],
                                                  self.v[i][:b, :, :width], attn_mask=mask)
            x = self._out(layer, x, attn.reshape(b, -1))
        return self.norm(x)

    def _views(self, b: int):
        """Per layer, per position p: (write view of k, of v at p, read view of k, of v up to p) for slots 0..b-1."""
        if b not in self._at:
            self._at[b] = [[(k[:b, :, p], v[:b, :, p], k[:b, :, :p + 1], v[:b, :, :p + 1]) for p in range(self.length)]
                           for k, v in zip(self.k, self.v)]
        return self._at[b]

    def first(self, x: torch.Tensor) -> torch.Tensor:
        """Two rows per slot 0..B-1, x [B, 2, H] at positions 0 and 1 (the code predictor's start)
        -> the normed hidden of the second row [B, H]."""
        b = x.shape[0]
        x = x.reshape(2 * b, -1)
        cos, sin = self.cos[:2, None].repeat(b, 1, 1), self.sin[:2, None].repeat(b, 1, 1)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            q, k, v = (t.view(b, 2, -1, self.hd).transpose(1, 2) for t in (q, k, v))
            self.k[i][:b, :, :2] = k
            self.v[i][:b, :, :2] = v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = self._out(layer, x, attn.transpose(1, 2).reshape(2 * b, -1))
        return self.norm(x.view(b, 2, -1)[:, 1])

    def next(self, x: torch.Tensor, p: int) -> torch.Tensor:
        """One row per slot 0..B-1, x [B, H], all at position p (the code predictor's later steps)
        -> the normed hidden [B, H]."""
        b = x.shape[0]
        cos, sin = self.cos[p], self.sin[p]
        for layer, views in zip(self.layers, self._views(b)):
            kw, vw, kr, vr = views[p]
            q, k, v = self._qkv(layer, x, cos, sin)
            kw.copy_(k)
            vw.copy_(v)
            attn = F.scaled_dot_product_attention(q[:, :, None], kr, vr, enable_gqa=True)
            x = self._out(layer, x, attn.view(b, -1))
        return self.norm(x)

    def move(self, src: int, dst: int) -> None:
        """Copy slot src's cache into slot dst."""
        for k, v in zip(self.k, self.v):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])


def talker_stack(model, slots: int, length: int, moe_impl: str) -> Stack:
    """From transformers' Qwen3OmniMoeTalkerModel."""
    c = model.config
    layers = [Layer.from_module(layer, Moe.from_block(layer.mlp, moe_impl)) for layer in model.layers]
    hd = model.layers[0].self_attn.head_dim
    return Stack(layers, model.norm.weight, model.norm.variance_epsilon, c.num_attention_heads,
                 c.num_key_value_heads, hd, model.rotary_emb, slots, length)


def dense_stack(model, slots: int, length: int) -> Stack:
    """From a stack of dense decoder layers (gate/up/down MLP): the Qwen3 code predictor, the Qwen2.5 talker."""
    c = model.config
    layers = [Layer.from_module(layer, (torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
                                        layer.mlp.down_proj.weight)) for layer in model.layers]
    hd = model.layers[0].self_attn.head_dim
    return Stack(layers, model.norm.weight, model.norm.variance_epsilon, c.num_attention_heads,
                 c.num_key_value_heads, hd, model.rotary_emb, slots, length)


def code_predictor_stack(model, slots: int) -> Stack:
    """From transformers' Qwen3OmniMoeTalkerCodePredictorModel; cache length = its 16 positions."""
    return dense_stack(model, slots, model.config.num_code_groups)
