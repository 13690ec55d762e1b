"""Token sampling for the torch LM engine: greedy, temperature, top-k, top-p, per-request RNG."""

from __future__ import annotations

import torch

from omni.engines.base import SamplingParams

SAMPLING_EPS = 1e-5     # vLLM's: a temperature below it samples greedily


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           history: list[tuple[list[int], list[int]]] | None = None, eos_ids: frozenset[int] = frozenset()
           ) -> list[int]:
    """logits [B, V] fp32 -> one token id per row. history: each row's (prompt, output so far),
    which penalties and min_tokens need."""
    if history is not None and any(p.shapes_logits() for p in params):
        logits = logits.clone()
        for row, p in enumerate(params):
            if p.shapes_logits():
                shape_logits(logits[row], p, *history[row], eos_ids)
    out = logits.argmax(dim=-1).tolist()          # greedy rows keep this
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature >= SAMPLING_EPS:
            out[row] = _sample_row(logits[row], p, gen)
    return out


def shape_logits(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                 eos_ids: frozenset[int]) -> None:
    """In place, in vLLM's order: min_tokens, logit_bias, then the penalties."""
    vocab = row.shape[-1]
    if len(output) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        idx = [t for t in banned if 0 <= t < vocab]
        if idx:
            row[idx] = float("-inf")
    for tok, bias in p.logit_bias.items():
        if 0 <= tok < vocab:
            row[tok] += bias
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        seen = seen[seen < vocab]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    scores = logits / p.temperature
    if torch.isposinf(scores).any() or torch.isnan(scores).any():
        # A tiny repetition penalty (any float > 0 is valid) overflowed the logits, and inf - inf is NaN
        # in the softmax: the gaps to the top instead (the overflowed tokens share the draw).
        finite = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max,
                                  neginf=float("-inf"))
        scores = (finite - finite.max()) / p.temperature
    if p.top_k > 0 and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
        drop[0] = False                 # a top_p below float32's range is 0: every mass reaches it
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
