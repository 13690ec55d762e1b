"""Token sampling for the torch LM engine: greedy, temperature, top-k, top-p, per-request RNG."""

from __future__ import annotations

import torch

from omni.engines.base import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
           ) -> list[int]:
    """logits [B, V] fp32 -> one token id per row."""
    out = logits.argmax(dim=-1).tolist()          # greedy rows keep this
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature > 0:
            out[row] = _sample_row(logits[row], p, gen)
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    scores = logits / p.temperature
    if p.top_k > 0 and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
