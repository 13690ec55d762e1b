"""The talkers' static decode step: device state for a fixed number of request slots.

Everything a frame needs lives on the device in preallocated tensors indexed by slot: the
talker's KV cache [slots, kv_heads, max_model_len, head_dim] per layer, each slot's position,
frame count, chosen-code mask (repetition penalty), sampling options, uniforms and the codec
part of its next input. A frame (talker step, code 0, for Qwen3 the 15 residual codes through the
code predictor, end detection) reads and writes only those tensors and a few small ints per row
(what text it consumes, whether it steps), so it runs with no host read-back and, on CUDA, as one
captured graph per batch bucket (omni/models/qwen3_omni/graphs.py). The host copies back one
tensor per step: each row's codes and its status (0 going, 1 a stop code, 2 max_tokens reached).

Slots 0..n-1 are the requests in flight (the host keeps them packed), so a decode batch is a
prefix view of every state tensor; a row that does not step this time (its text has not
arrived) runs masked: its cache write lands on its next, unused position and none of its
state changes. `SlotState` is the part both talkers share; `StaticTalker` is Qwen3-Omni's frame
(Qwen2.5-Omni's: omni/models/qwen25_omni/static_step.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni.models.qwen3_omni.codes import RESIDUAL, Pick
from omni.models.qwen3_omni.layers import code_predictor_stack, talker_stack
from omni.models.qwen3_omni.sampling import penalize, sample

GOING, STOP, LENGTH = 0, 1, 2      # a row's status after a frame


class SlotState:
    """Per-slot state, admission, code 0 and the host copies, for a talker whose backbone is `self.backbone`."""

    def __init__(self, *, slots: int, length: int, vocab: int, hidden: int, dtype, device, groups: int,
                 inputs: int, suppress: torch.Tensor, stop_ids: list[int]):
        self.slots, self.length, self.groups, self.device = slots, length, groups, device
        z = dict(device=device)
        self.pos = torch.zeros(slots, dtype=torch.long, **z)             # next position to write
        self.frame = torch.zeros(slots, dtype=torch.long, **z)           # code 0s chosen so far
        self.seen = torch.zeros((slots, vocab), dtype=torch.bool, **z)
        self.fparams = torch.zeros((slots, 3), **z)                      # penalty, temperature, top_p
        self.iparams = torch.zeros((slots, 3), dtype=torch.long, **z)    # top_k, max_tokens, min_tokens
        self.uniforms = torch.zeros((slots, length, groups), **z)
        self.codec_next = torch.zeros((slots, hidden), dtype=dtype, **z)
        self.inputs = torch.zeros((inputs + 1, slots), dtype=torch.long, **z)   # per row: inputs, then steps (0/1)
        pin = torch.device(device).type == "cuda"
        self.host_inputs = torch.zeros((inputs + 1, slots), dtype=torch.long, pin_memory=pin)
        self.host_out = torch.zeros((2 * slots, groups + 1), dtype=torch.long, pin_memory=pin)
        self.positions = torch.arange(length, **z)
        self.suppress = suppress
        self.stop = torch.tensor(stop_ids, dtype=torch.long, **z)
        self.ends = torch.zeros(vocab, dtype=torch.bool, **z)           # the stop ids, held back before min_tokens
        self.ends[self.stop] = True

    def admit(self, slot: int, x: torch.Tensor, *, penalty: float, temperature: float, top_k: int,
              top_p: float, max_tokens: int, uniforms: torch.Tensor | None, seen: tuple[int, ...] = (),
              min_tokens: int = 0) -> torch.Tensor:
        """Reset `slot` for a new request and prefill its rows x [T, H] -> the last normed hidden [H].
        `seen`: codes the repetition penalty counts from the start (Qwen2.5's prompt codes)."""
        t = x.shape[0]
        if t >= self.length:
            raise ValueError(f"the talker prefill has {t} rows; max_model_len {self.length} leaves no room to decode")
        self.pos[slot].fill_(t)
        self.frame[slot].zero_()
        self.seen[slot].zero_()
        if seen:
            self.seen[slot, torch.tensor(seen).to(self.device, non_blocking=True)] = True
        self.fparams[slot].copy_(torch.tensor([penalty, temperature, top_p]), non_blocking=True)
        self.iparams[slot].copy_(torch.tensor([top_k, max_tokens, min_tokens]), non_blocking=True)
        if uniforms is not None:
            n = min(uniforms.shape[0], self.length)
            self.uniforms[slot, :n].copy_(uniforms[:n], non_blocking=True)
        return self.backbone.prefill(x, slot)[-1]

    def move(self, src: int, dst: int) -> None:
        """Slot src's request now lives in dst (the host keeps slots packed)."""
        self.backbone.move(src, dst)
        for t in (self.pos, self.frame, self.seen, self.fparams, self.iparams, self.uniforms, self.codec_next):
            t[dst].copy_(t[src])

    def load_inputs(self, columns: list[list[int]]) -> None:
        """The step's per-row inputs (the last column: whether the row steps), for slots 0..n-1."""
        n = len(columns[0]) if columns else 0
        for i, column in enumerate(columns):
            self.host_inputs[i, :n] = torch.tensor(column, dtype=torch.long)
        self.host_inputs[:, n:] = 0
        self.inputs.copy_(self.host_inputs, non_blocking=True)

    def first_frames(self, hidden: torch.Tensor, slots: list[int], sampled: bool) -> torch.Tensor:
        """The frames that prefills chose: hidden [P, H] for `slots` -> codes and status [P, groups + 1]."""
        rows = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        return self.frame_rows(hidden, rows, None, sampled)

    def code0(self, logits: torch.Tensor, rows, steps: torch.Tensor | None, sampled: bool):
        """Code 0 from logits [B, V] (float32) for the slots `rows` (a slice or an index tensor), with the
        slot's penalty, suppression and sampling; updates the slot's chosen codes and frame count.
        -> (code [B], status [B], uniforms of the frame [B, G] or None, greedy [B])."""
        fp, ip, f = self.fparams[rows], self.iparams[rows], self.frame[rows]
        seen = self.seen[rows]
        logits = penalize(logits, seen, fp[:, 0]).masked_fill(self.suppress, float("-inf"))
        logits = logits.masked_fill((f < ip[:, 2])[:, None] & self.ends, float("-inf"))    # min_tokens, ignore_eos
        greedy = fp[:, 1] <= 0
        u = None
        if sampled:
            at = f.clamp(max=self.length - 1)[:, None, None].expand(-1, 1, self.groups)
            u = self.uniforms[rows].gather(1, at)[:, 0]                        # [B, G]
            code = sample(logits, u[:, 0], fp[:, 1], ip[:, 0], fp[:, 2], greedy)
        else:
            code = logits.argmax(-1)
        stop = (code[:, None] == self.stop[None]).any(-1)
        status = torch.where(stop, STOP, torch.where(f + 1 >= ip[:, 1], LENGTH, GOING))
        # state updates last: with `rows` a slice, fp / ip / f / seen are views of the state
        go = torch.ones_like(code, dtype=torch.bool) if steps is None else steps
        chosen = seen.gather(1, code[:, None]) | go[:, None]
        self.seen[rows] = seen.scatter(1, code[:, None], chosen)
        self.frame[rows] = f + go
        return code, status, u, greedy

    def set_codec(self, rows, steps: torch.Tensor | None, codec: torch.Tensor) -> None:
        self.codec_next[rows] = codec if steps is None else torch.where(steps[:, None], codec, self.codec_next[rows])

    def attention_mask(self, pos: torch.Tensor, width: int, masked: bool) -> torch.Tensor | None:
        return (self.positions[:width] <= pos[:, None])[:, None, None] if masked else None

    def to_host(self, out: torch.Tensor):
        """The step's one device-to-host copy -> a numpy array [rows, groups + 1] (valid until the next step)."""
        if out.device.type != "cuda":
            return out.numpy()
        m = out.shape[0]
        self.host_out[:m].copy_(out, non_blocking=True)
        torch.cuda.current_stream(out.device).synchronize()
        return self.host_out[:m].numpy()


class StaticTalker(SlotState):
    """Qwen3-Omni: the MoE talker, then the code predictor's 15 residual codes. Inputs per row: the thinker
    id whose text row the step consumes."""

    def __init__(self, talker, embed: torch.Tensor, suppress: torch.Tensor, eos: int, *, slots: int,
                 max_model_len: int, moe_impl: str, residual: Pick = RESIDUAL):
        tc = talker.config.text_config
        acts = {tc.hidden_act, talker.config.code_predictor_config.hidden_act}
        if acts != {"silu"}:
            raise ValueError(f"the static talker step needs silu activations, the config has {sorted(acts)}")
        super().__init__(slots=slots, length=max_model_len, vocab=tc.vocab_size, hidden=tc.hidden_size,
                         dtype=talker.codec_head.weight.dtype, device=embed.device,
                         groups=talker.config.num_code_groups, inputs=1, suppress=suppress, stop_ids=[eos])
        self.backbone = talker_stack(talker.model, slots, max_model_len, moe_impl)
        self.cp = code_predictor_stack(talker.code_predictor.model, slots)
        self.codec_head = talker.codec_head.weight
        self.codec_embed = talker.model.codec_embedding.weight
        self.cp_embed = [e.weight for e in talker.code_predictor.model.codec_embedding]
        self.cp_heads = [h.weight for h in talker.code_predictor.lm_head]
        p = talker.text_projection
        self.text_proj = (p.linear_fc1.weight, p.linear_fc1.bias, p.linear_fc2.weight, p.linear_fc2.bias)
        self.embed = embed
        # the code predictor's sampling (subtalker_sampling_params): constants of the step, captured as such
        self.residual_how = residual

    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """talker.text_projection(thinker embedding) of ids [B] -> [B, H]."""
        w1, b1, w2, b2 = self.text_proj
        return F.linear(F.silu(F.linear(self.embed[ids], w1, b1)), w2, b2)

    def decode(self, n: int, width: int, masked: bool, sampled: bool) -> torch.Tensor:
        """One frame for slots 0..n-1 from `inputs` (copied in by `load_inputs`) -> [n, 17].
        Attention reads `width` positions; masked=False when every stepping row is at width - 1."""
        ids, steps = self.inputs[0, :n], self.inputs[1, :n]
        pos = self.pos[:n]
        x = self.codec_next[:n] + self.text_rows(ids)
        h = self.backbone.decode(x, pos, width, self.attention_mask(pos, width, masked))
        pos.add_(steps)
        return self.frame_rows(h, slice(0, n), steps.bool(), sampled)

    def frame_rows(self, h: torch.Tensor, rows, steps: torch.Tensor | None, sampled: bool) -> torch.Tensor:
        """Code 0 from the talker's hidden h [B, H], then the code predictor's residual codes, for the
        slots `rows`; `steps` [B] bool: rows whose state advances (None: all)."""
        code0, status, u, greedy = self.code0(F.linear(h, self.codec_head).float(), rows, steps, sampled)
        codes, codec = self.residual(h, code0, u, greedy)
        self.set_codec(rows, steps, codec)
        return torch.cat([codes, status[:, None]], dim=1)

    def residual(self, h: torch.Tensor, code0: torch.Tensor, u: torch.Tensor | None, greedy: torch.Tensor):
        """The code predictor: (codes [B, G] with code 0 first, the sum of their embeddings [B, H])."""
        how = self.residual_how
        first = F.embedding(code0, self.codec_embed)
        codes, embeds = [code0], [first]
        hidden = self.cp.first(torch.stack([h, first], dim=1))
        for g in range(1, self.groups):
            logits = F.linear(hidden, self.cp_heads[g - 1]).float()
            code = logits.argmax(-1) if u is None or how.greedy else sample(
                logits, u[:, g], how.temperature, how.top_k, how.top_p, greedy)
            e = F.embedding(code, self.cp_embed[g - 1])
            codes.append(code)
            embeds.append(e)
            if g < self.groups - 1:
                hidden = self.cp.next(e, g + 1)
        # one reduction over the 16 rows, as transformers sums them (order matters in float)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(1)
