"""Batched code sampling on the device, shared by the talkers' eager and static paths.

transformers' talker maths (logits in float32, repetition penalty, suppressed ids, then
temperature, top-k, top-p as its logits warpers) with per-row options as tensors, so one
call serves a batch whose requests sample differently and nothing is read back to the host.

The random draw is inverse-CDF: each row takes ONE uniform u in [0, 1) and picks, in
ascending (stable) order of its warped scores, the first entry whose cumulative probability
exceeds u times the total. That is exact categorical sampling, needs one number per code
instead of one per vocabulary entry, and lets a request's uniforms be drawn ahead, on the
host, from its own seeded generator (`Uniforms`): a seeded request draws the same codes
whatever shares its batch, on any device, through either path.
"""

from __future__ import annotations

import torch

BLOCK_FRAMES = 256     # uniforms are drawn in blocks of this many frames (the stream's definition)


class Uniforms:
    """A request's uniforms: `groups` per frame, from a CPU generator seeded with `seed` (None: the
    global RNG). Drawn in blocks of BLOCK_FRAMES frames, so a prefix is the same however far it is read."""

    def __init__(self, seed: int | None, groups: int):
        self.groups = groups
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.table = torch.empty((0, groups))

    def rows(self, frames: int) -> torch.Tensor:
        """The first `frames` rows [frames, groups] (float32, CPU)."""
        while self.table.shape[0] < frames:
            block = torch.rand((BLOCK_FRAMES, self.groups), generator=self.generator)
            self.table = torch.cat([self.table, block])
        return self.table[:frames]


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor for a batch: at ids already chosen (`seen`
    [B, V] bool) divide positive logits by the row's penalty [B], multiply negative ones."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)


def sample(logits: torch.Tensor, u: torch.Tensor, temperature, top_k, top_p,
           greedy: torch.Tensor | None = None) -> torch.Tensor:
    """One code per row of `logits` [B, V] (float32, penalties and suppression applied).

    `u` [B] uniforms; temperature / top_k / top_p: a number for every row or a tensor [B]
    (top_k 0 = off); `greedy` [B] bool: rows that take the argmax instead (their other options
    are ignored). Returns int64 [B]."""
    v = logits.shape[-1]
    if torch.is_tensor(temperature):
        temperature = torch.where(temperature > 0, temperature, 1.0)[:, None]
    scores = logits / temperature
    s, order = torch.sort(scores, dim=-1, stable=True)              # ascending
    if torch.is_tensor(top_k):
        kth = torch.where((top_k > 0) & (top_k < v), v - top_k, 0)[:, None]
        s = s.masked_fill(s < s.gather(1, kth), float("-inf"))
    elif 0 < top_k < v:
        s = s.masked_fill(s < s[:, v - top_k:v - top_k + 1], float("-inf"))
    if torch.is_tensor(top_p) or top_p < 1.0:
        # top-p as transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep the top one
        cum = torch.softmax(s, -1).cumsum(-1)
        drop = cum <= ((1 - top_p)[:, None] if torch.is_tensor(top_p) else 1 - top_p)
        drop[:, -1] = False
        s = s.masked_fill(drop, float("-inf"))
    cum = torch.softmax(s, -1).cumsum(-1)
    idx = (cum <= u[:, None] * cum[:, -1:]).sum(-1, keepdim=True).clamp_(max=v - 1)
    code = order.gather(1, idx)[:, 0]
    if greedy is None:
        return code
    return torch.where(greedy, logits.argmax(-1), code)
