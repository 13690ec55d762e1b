"""Per-token log probabilities of generated text (OpenAI's `logprobs` / `top_logprobs`).

Semantics are vLLM's default `logprobs_mode="raw_logprobs"`: log_softmax of the model's raw
logits, before logit_bias, min_tokens, penalties, temperature, top-k and top-p, so a sampled
token's logprob does not depend on how it was sampled.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's default ModelConfig.max_logprobs; the API refuses more, the engines check again.
MAX_LOGPROBS = 20


class Logprobs(msgspec.Struct, frozen=True, array_like=True):
    """One entry per generated token id of the output that carries it (same order): the sampled
    token's logprob and the top-k alternatives, best first (k = the request's `logprobs`).
    Bounded: k <= MAX_LOGPROBS, one row per token id of its output."""
    sampled: list[float]
    top_ids: list[list[int]]
    top: list[list[float]]

    def __len__(self) -> int:
        return len(self.sampled)

    def rows(self):
        """(sampled logprob, [(token id, logprob)] best first) per token."""
        for lp, ids, lps in zip(self.sampled, self.top_ids, self.top):
            yield lp, list(zip(ids, lps))


def join(a: Logprobs | None, b: Logprobs | None) -> Logprobs | None:
    if a is None or b is None:
        return a if b is None else b
    return Logprobs(a.sampled + b.sampled, a.top_ids + b.top_ids, a.top + b.top)


def check_k(k: int | None) -> None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"logprobs={k} must be in [0, {MAX_LOGPROBS}]")


def from_logits(logits, tokens: list[int], ks: list[int | None]) -> list[Logprobs | None]:
    """Rows of raw logits [B, V] (before any sampling processing) and each row's sampled token ->
    each row's Logprobs, None where its request asked for none."""
    import torch

    out: list[Logprobs | None] = [None] * len(tokens)
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    kmax = max(ks[i] for i in rows)
    vals, ids = torch.topk(lp, kmax, dim=-1) if kmax else (None, None)
    for j, i in enumerate(rows):
        k = ks[i]
        out[i] = Logprobs([float(lp[j, tokens[i]])], [ids[j, :k].tolist() if k else []],
                          [vals[j, :k].tolist() if k else []])
    return out


def from_vllm(token_ids: list[int], steps: Any, k: int) -> Logprobs:
    """vLLM's sample logprobs (one {token id: Logprob} per generated token: the sampled token
    first, then the top-k ranks, the sampled one merged in when it is among them) -> Logprobs.
    Top entries are the k best by rank (OpenAI's meaning; vLLM's own server lists the sampled
    token first, which is the same list when it is the best, as under greedy decoding)."""
    sampled, top_ids, top = [], [], []
    for tok, d in zip(token_ids, steps):
        items = list(d.items())
        sampled.append(float(d[tok].logprob))
        best = sorted(items[max(0, len(items) - k):], key=lambda kv: kv[1].rank) if k else []
        top_ids.append([int(t) for t, _ in best])
        top.append([float(v.logprob) for _, v in best])
    return Logprobs(sampled, top_ids, top)
