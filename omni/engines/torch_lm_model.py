"""A batched forward pass over an HF Llama-family model with a per-slot KV cache.

We load the HF model only for its modules (projections, norms, MLPs, rotary
embedding) and run our own forward so that one call covers every running
sequence: the cache is [layers, slots, kv_heads, max_len, head_dim] for K and
V, each slot has its own length, and decode attends through a length mask.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from omni.errors import ConfigError

logger = logging.getLogger(__name__)

# Architectures whose decoder layers have the Llama shape: pre-norm attention
# with q/k/v/o projections (Qwen2 adds biases, Qwen3 adds per-head q/k norms).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class BatchedLM:
    """Weights + KV cache + batched prefill/decode. No scheduling here."""

    def __init__(self, model_path: str, dtype: torch.dtype, max_num_seqs: int, max_model_len: int):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        model.eval()
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model at {model_path} has model_type {cfg.model_type!r}; the torch engine supports "
                + ", ".join(SUPPORTED_MODEL_TYPES))
        if getattr(cfg, "use_sliding_window", False):
            raise ConfigError(f"model at {model_path} uses sliding-window attention, not supported")
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit is not None and max_model_len > limit:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the model's "
                              f"max_position_embeddings {limit}")
        self.model = model
        self.config = cfg
        self.dtype = dtype
        self.layers = list(model.model.layers)
        self.on_layer: Callable[[], None] | None = None   # after each layer (progress marks: engines/base.py)
        attn0 = self.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.scaling = attn0.scaling
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # cos/sin for every position once; HF computes them in fp32 and casts to the model dtype.
        pos = torch.arange(max_model_len).unsqueeze(0)
        probe = torch.zeros(1, dtype=dtype)
        with torch.inference_mode():
            cos, sin = model.model.rotary_emb(probe, pos)
        self.cos = cos[0].to(dtype)
        self.sin = sin[0].to(dtype)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.alloc_cache()

    # ---- KV cache ----------------------------------------------------------------
    def cache_bytes(self) -> int:
        per = len(self.layers) * self.max_num_seqs * self.num_kv_heads * self.max_model_len * self.head_dim
        return 2 * per * torch.tensor([], dtype=self.dtype).element_size()

    def alloc_cache(self) -> None:
        shape = (len(self.layers), self.max_num_seqs, self.num_kv_heads, self.max_model_len, self.head_dim)
        # zeros, not empty: masked positions must hold finite values (0 * NaN is NaN in attention).
        self.k_cache = torch.zeros(shape, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, dtype=self.dtype)

    def free_cache(self) -> None:
        self.k_cache = None
        self.v_cache = None

    # ---- forward -----------------------------------------------------------------
    def _qkv(self, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [B, T, D] -> q [B, H, T, hd], k/v [B, KV, T, hd] with RoPE applied."""
        attn = layer.self_attn
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, -1, self.head_dim)
        k = attn.k_proj(h).view(b, t, -1, self.head_dim)
        v = attn.v_proj(h).view(b, t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)      # [B, 1, T, hd]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _finish_layer(self, layer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn_out.shape
        x = x + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if self.on_layer is not None:
            self.on_layer()
        return x

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one prompt into `slot` from position 0.

        Returns (logits of the last position [V] fp32, final-norm hidden [T, D]).
        """
        t = len(token_ids)
        x = self.model.model.embed_tokens(torch.tensor([token_ids]))
        cos, sin = self.cos[:t].unsqueeze(0), self.sin[:t].unsqueeze(0)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.k_cache[i, slot, :, :t] = k[0]
            self.v_cache[i, slot, :, :t] = v[0]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
            x = self._finish_layer(layer, x, out)
        hidden = self.model.model.norm(x)[0]                       # [T, D]
        logits = self.model.lm_head(hidden[-1:]).float()[0]
        return logits, hidden

    @torch.inference_mode()
    def decode(self, slots: list[int], token_ids: list[int], positions: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each of len(slots) sequences in one forward.

        token_ids[b] is fed at positions[b] (== the slot's cached length).
        Returns (logits [B, V] fp32, final-norm hidden [B, D]).
        """
        b = len(slots)
        pos = torch.tensor(positions)
        span = int(pos.max()) + 1                                   # attend only as far as needed
        # Slots are handed out lowest-first, so the batch is usually 0..B-1: a view, no gather.
        compact = slots == list(range(b))
        slot_idx = torch.tensor(slots)
        mask = (torch.arange(span).unsqueeze(0) <= pos.unsqueeze(1)).view(b, 1, 1, span)
        x = self.model.model.embed_tokens(torch.tensor(token_ids).unsqueeze(1))   # [B, 1, D]
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)        # [B, 1, hd]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[slot_idx, :, pos] = k[:, :, 0]
            vc[slot_idx, :, pos] = v[:, :, 0]
            if compact:
                keys, values = kc[:b, :, :span], vc[:b, :, :span]
            else:
                keys, values = kc[slot_idx, :, :span], vc[slot_idx, :, :span]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                                 enable_gqa=True)
            x = self._finish_layer(layer, x, out)
        hidden = self.model.model.norm(x)[:, 0]                    # [B, D]
        logits = self.model.lm_head(hidden).float()
        return logits, hidden
