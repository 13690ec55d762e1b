"""Choosing codec codes: the talker's code 0 and the code predictor's 15 residual codes.

The same maths as transformers' talker generate (logits in float32, repetition penalty,
suppressed special ids, temperature / top-k / top-p), drawn by omni.models.qwen3_omni.sampling
from the request's own uniforms, so a seeded request draws the same codes whatever else shares
its batch, and the eager and static paths draw the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni.models.qwen3_omni.sampling import sample


@dataclass(frozen=True)
class Pick:
    """How one request chooses a code: greedy when temperature <= 0."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


RESIDUAL = Pick(1.0, 50, 0.8)     # the code predictor's options when the talker samples (transformers')


def residual_pick(params: dict | None) -> Pick:
    """The code predictor's options from vllm-omni's subtalker_sampling_params (do_sample, temperature, top_k,
    top_p; checked as at config load) over RESIDUAL: do_sample false or temperature 0 is greedy, top_k -1 or 0 off."""
    from omni.config_stage_checks import check_subtalker

    p = check_subtalker(params, "subtalker_sampling_params")
    temperature = 0.0 if p.get("do_sample") is False else float(p.get("temperature", RESIDUAL.temperature))
    return Pick(temperature, max(0, int(p.get("top_k", RESIDUAL.top_k))), float(p.get("top_p", RESIDUAL.top_p)))


def repetition_penalty(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor for one row: divide positive, multiply negative."""
    if penalty == 1.0 or not history:
        return logits
    idx = torch.as_tensor(sorted(set(history)), dtype=torch.long).to(logits.device, non_blocking=True)
    score = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(score < 0, score * penalty, score / penalty)
    return logits


def pick(logits: torch.Tensor, how: Pick, u: torch.Tensor | None = None) -> int:
    """One code from a 1-D row of logits; `u` the request's uniform for it (sampling only)."""
    if how.greedy:
        return int(torch.argmax(logits))
    return int(sample(logits[None].float(), u.reshape(1).to(logits.device), how.temperature, how.top_k,
                      how.top_p)[0])


def suppress_mask(vocab: int, eos: int, device=None) -> torch.Tensor:
    """True at the ids code 0 may never take: the top 1024 ids of the codec vocabulary except EOS."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[max(0, vocab - 1024):] = True
    mask[eos] = False
    return mask


@torch.no_grad()
def residual_codes(talker, hidden: torch.Tensor, code0: torch.Tensor, greedy: torch.Tensor,
                   u: torch.Tensor | None = None, how: Pick = RESIDUAL):
    """The code predictor for a batch of frames.

    hidden [B, H]: the talker's last normed hidden that chose code 0; code0 [B]; greedy [B] bool:
    rows whose residual codes are greedy (the others sample with `how`, the engine's residual_pick;
    greedy too when `how` is); u [B, G]: the rows' uniforms for this frame (None when every row is greedy).
    Returns (codes [B, G] int64 with code 0 first, codec embedding sum [B, H]: the
    codec part of the talker's next input).
    """
    from transformers import DynamicCache

    cp = talker.code_predictor
    groups = talker.config.num_code_groups
    first = talker.get_input_embeddings()(code0)                       # [B, H]
    embeds = [first]
    codes = [code0]
    cache = DynamicCache(config=cp.config)
    x = torch.stack([hidden, first], dim=1)                            # [B, 2, H]
    out = cp.model(inputs_embeds=x, past_key_values=cache, use_cache=True)
    for g in range(1, groups):
        logits = cp.lm_head[g - 1](out.last_hidden_state[:, -1]).float()
        code = logits.argmax(-1) if u is None or how.greedy else sample(
            logits, u[:, g], how.temperature, how.top_k, how.top_p, greedy)
        codes.append(code)
        e = cp.model.get_input_embeddings()[g - 1](code)
        embeds.append(e)
        if g < groups - 1:
            out = cp.model(inputs_embeds=e[:, None], past_key_values=cache, use_cache=True)
    # One reduction over the 16 rows, as transformers sums them (order matters in float).
    return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(1)
