"""Sampling: the request's own parameters, and a stage's overrides of them.

Torch-free so config loading (which validates deploy `default_sampling_params`) stays fast.
"""

from __future__ import annotations

from typing import Any

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_tokens: int = 64
    temperature: float = 0.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 means off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's / vLLM's: penalties over the tokens generated so far (repetition: prompt too),
    # additive logit_bias, and no stop (EOS or stop ids) before min_tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    # None: no logprobs; k >= 0: the sampled token's logprob and the top k (omni.engines.logprobs).
    logprobs: int | None = None

    def shapes_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


class SamplingOverrides(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A stage's own sampling (its deploy `default_sampling_params`); None: the request's value.

    The stage that takes the client's prompt gets its defaults folded under the client's own
    values by the frontend (as vLLM's generation-config defaults); every later stage gets them
    here, over the request's (the client's temperature is the thinker's, not the talker's)."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # A talker takes only its codec's end id (it stops there anyway); the stage taking the prompt, any.
    stop_token_ids: tuple[int, ...] | None = None
    # Piper (VITS) priors: the phoneme-duration and latent noise scales.
    noise_scale: float | None = None
    noise_w_scale: float | None = None

    def set(self) -> dict[str, Any]:
        """The fields this stage sets."""
        return {k: v for k in self.__struct_fields__ if (v := getattr(self, k)) is not None}

    def over(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with every SamplingParams field this stage sets replaced."""
        own = {k: v for k, v in self.set().items() if k in SamplingParams.__struct_fields__}
        return msgspec.structs.replace(sampling, **own) if own else sampling


OVERRIDE_KEYS = SamplingOverrides.__struct_fields__


def parse_overrides(data: dict[str, Any], where: str) -> SamplingOverrides:
    """A deploy `default_sampling_params` mapping, checked: an unknown key or a wrong type is one
    line naming it."""
    unknown = sorted(set(data) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(OVERRIDE_KEYS)})")
    try:
        return msgspec.convert(data, SamplingOverrides, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"{where}: {str(e).replace('`$.', '`')}") from None
