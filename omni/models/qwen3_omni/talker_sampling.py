"""A talker request's sampling: the stage's own values over the request's, checked.

The request's own sampling is the client's, meant for the thinker; only its temperature, top_k, top_p,
max_tokens and seed reach the talker where the stage sets none (`EngineRequest.effective_sampling`). What
only the talker's own sampling (deploy default_sampling_params, a sampling_params_list entry) may set:
repetition_penalty, stop_token_ids (the codec's end alone), min_tokens (no codec end before that many
codes, as vLLM's) and ignore_eos (no codec end at all: max_tokens ends it). The codec end is
suppressed rather than drawn and passed over: a frame of end codes is no audio. presence and frequency
penalties are refused by name (omni.config_checks.TALKER_REFUSED)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omni.config_checks import TALKER_REFUSED, talker_refusal
from omni.engines.base import EngineError, EngineRequest


@dataclass(frozen=True)
class TalkerSampling:
    temperature: float
    top_k: int            # 0: off (vLLM's -1 too)
    top_p: float
    max_tokens: int
    penalty: float        # repetition penalty
    seed: int | None      # None: unseeded
    min_tokens: int       # codes before the codec end may be chosen (max_tokens with ignore_eos)


def talker_sampling(engine: str, req: EngineRequest, default_penalty: float, codec_stops: set[int]) -> TalkerSampling:
    rid, own = req.request_id, req.overrides
    s = req.effective_sampling()
    refused = talker_refusal(TALKER_REFUSED.get(engine, {}), own, codec_stops)   # the frontend's check too
    if refused is not None:
        name, why = refused
        raise EngineError(f"request {rid}: the talker's {name} is not supported: {why}; got {_shown(getattr(own, name))}")
    penalty = default_penalty if own.repetition_penalty is None else own.repetition_penalty
    top_k = 0 if s.top_k == -1 else s.top_k
    min_tokens = s.max_tokens if own.ignore_eos else own.min_tokens or 0
    if not (math.isfinite(s.temperature) and top_k >= 0 and 0 < s.top_p <= 1 and s.max_tokens >= 1
            and math.isfinite(penalty) and penalty > 0 and min_tokens >= 0):
        raise EngineError(f"request {rid}: sampling needs a finite temperature, top_k >= -1, "
                          f"0 < top_p <= 1, max_tokens >= 1, repetition_penalty > 0 and min_tokens >= 0; got "
                          f"{s.temperature}, {s.top_k}, {s.top_p}, {s.max_tokens}, {penalty}, {min_tokens}")
    return TalkerSampling(s.temperature, top_k, s.top_p, s.max_tokens, penalty, s.seed, min(min_tokens, s.max_tokens))


def _shown(v) -> object:
    return list(v) if isinstance(v, tuple) else v


def hold_ends(row: torch.Tensor, chosen: int, min_tokens: int, ends: torch.Tensor) -> torch.Tensor:
    """An eager step's logits row with the codec end ids (`ends`, a bool mask) suppressed while fewer than
    min_tokens codes were chosen (the static step does the same on the device: SlotState.code0)."""
    return row.masked_fill(ends, float("-inf")) if chosen < min_tokens else row


def end_mask(vocab: int, stops: set[int], device) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[sorted(stops)] = True
    return mask
