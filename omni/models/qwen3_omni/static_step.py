"""The Qwen3-Omni talker's static decode step: device state for a fixed number of request slots.

Everything a frame needs lives on the device in preallocated tensors indexed by slot: the
talker's KV cache [slots, kv_heads, max_model_len, head_dim] per layer, each slot's position,
frame count, chosen-code mask (repetition penalty), sampling options, uniforms and the codec
part of its next input. A frame (talker step, code 0, the 15 residual codes through the code
predictor, end detection) reads and writes only those tensors and two small inputs per row
(the text id it consumes, whether it steps), so it runs with no host read-back and, on CUDA,
as one captured graph per batch bucket (omni/models/qwen3_omni/graphs.py). The host copies
back one tensor per step: each row's 16 codes and its status (0 going, 1 codec EOS, 2 max_tokens).

Slots 0..n-1 are the requests in flight (the host keeps them packed), so a decode batch is a
prefix view of every state tensor; a row that does not step this time (its text has not
arrived) runs masked: its cache write lands on its next, unused position and none of its
state changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni.models.qwen3_omni.codes import RESIDUAL
from omni.models.qwen3_omni.layers import code_predictor_stack, talker_stack
from omni.models.qwen3_omni.sampling import penalize, sample

GOING, EOS, LENGTH = 0, 1, 2      # a row's status after a frame


class StaticTalker:
    def __init__(self, talker, embed: torch.Tensor, suppress: torch.Tensor, eos: int, *, slots: int,
                 max_model_len: int, moe_impl: str):
        tc = talker.config.text_config
        acts = {tc.hidden_act, talker.config.code_predictor_config.hidden_act}
        if acts != {"silu"}:
            raise ValueError(f"the static talker step needs silu activations, the config has {sorted(acts)}")
        self.slots, self.length = slots, max_model_len
        self.backbone = talker_stack(talker.model, slots, max_model_len, moe_impl)
        self.cp = code_predictor_stack(talker.code_predictor.model, slots)
        self.groups = talker.config.num_code_groups
        self.codec_head = talker.codec_head.weight
        self.codec_embed = talker.model.codec_embedding.weight
        self.cp_embed = [e.weight for e in talker.code_predictor.model.codec_embedding]
        self.cp_heads = [h.weight for h in talker.code_predictor.lm_head]
        p = talker.text_projection
        self.text_proj = (p.linear_fc1.weight, p.linear_fc1.bias, p.linear_fc2.weight, p.linear_fc2.bias)
        self.embed, self.suppress, self.eos = embed, suppress, eos
        dev, dt = embed.device, self.codec_head.dtype
        self.device = dev
        z = dict(device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, **z)             # next position to write
        self.frame = torch.zeros(slots, dtype=torch.long, **z)           # code 0s chosen so far
        self.seen = torch.zeros((slots, tc.vocab_size), dtype=torch.bool, **z)
        self.fparams = torch.zeros((slots, 3), **z)                      # penalty, temperature, top_p
        self.iparams = torch.zeros((slots, 2), dtype=torch.long, **z)    # top_k, max_tokens
        self.uniforms = torch.zeros((slots, max_model_len, self.groups), **z)
        self.codec_next = torch.zeros((slots, tc.hidden_size), dtype=dt, **z)
        self.inputs = torch.zeros((2, slots), dtype=torch.long, **z)     # text id, steps (0/1) per row
        pin = dev.type == "cuda"
        self.host_inputs = torch.zeros((2, slots), dtype=torch.long, pin_memory=pin)
        self.host_out = torch.zeros((2 * slots, self.groups + 1), dtype=torch.long, pin_memory=pin)
        self.positions = torch.arange(max_model_len, **z)

    # -- slots -----------------------------------------------------------------

    def admit(self, slot: int, x: torch.Tensor, *, penalty: float, temperature: float, top_k: int,
              top_p: float, max_tokens: int, uniforms: torch.Tensor | None) -> torch.Tensor:
        """Reset `slot` for a new request and prefill its rows x [T, H] -> the last normed hidden [H]."""
        t = x.shape[0]
        if t >= self.length:
            raise ValueError(f"the talker prefill has {t} rows; max_model_len {self.length} leaves no room to decode")
        self.pos[slot].fill_(t)
        self.frame[slot].zero_()
        self.seen[slot].zero_()
        host = torch.tensor([penalty, temperature, top_p])
        self.fparams[slot].copy_(host, non_blocking=True)
        self.iparams[slot].copy_(torch.tensor([top_k, max_tokens]), non_blocking=True)
        if uniforms is not None:
            n = min(uniforms.shape[0], self.length)
            self.uniforms[slot, :n].copy_(uniforms[:n], non_blocking=True)
        return self.backbone.prefill(x, slot)[-1]

    def move(self, src: int, dst: int) -> None:
        """Slot src's request now lives in dst (the host keeps slots packed)."""
        self.backbone.move(src, dst)
        for t in (self.pos, self.frame, self.seen, self.fparams, self.iparams, self.uniforms, self.codec_next):
            t[dst].copy_(t[src])

    # -- frames ----------------------------------------------------------------

    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """talker.text_projection(thinker embedding) of ids [B] -> [B, H]."""
        w1, b1, w2, b2 = self.text_proj
        return F.linear(F.silu(F.linear(self.embed[ids], w1, b1)), w2, b2)

    def first_frames(self, hidden: torch.Tensor, slots: list[int], sampled: bool) -> torch.Tensor:
        """The frames that prefills chose: hidden [P, H] for `slots` -> codes and status [P, 17]."""
        rows = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        return self.frame_rows(hidden, rows, None, sampled)

    def decode(self, n: int, width: int, masked: bool, sampled: bool) -> torch.Tensor:
        """One frame for slots 0..n-1 from `inputs` (copied in by `load_inputs`) -> [n, 17].
        Attention reads `width` positions; masked=False when every stepping row is at width - 1."""
        ids, steps = self.inputs[0, :n], self.inputs[1, :n]
        pos = self.pos[:n]
        x = self.codec_next[:n] + self.text_rows(ids)
        mask = (self.positions[:width] <= pos[:, None])[:, None, None] if masked else None
        h = self.backbone.decode(x, pos, width, mask)
        pos.add_(steps)
        return self.frame_rows(h, slice(0, n), steps.bool(), sampled)

    def load_inputs(self, ids: list[int], steps: list[int]) -> None:
        n = len(ids)
        self.host_inputs[0, :n] = torch.tensor(ids)
        self.host_inputs[1, :n] = torch.tensor(steps)
        self.host_inputs[:, n:] = 0
        self.inputs.copy_(self.host_inputs, non_blocking=True)

    def frame_rows(self, h: torch.Tensor, rows, steps: torch.Tensor | None, sampled: bool) -> torch.Tensor:
        """Code 0 from the talker's hidden h [B, H], then the code predictor's residual codes, for the
        slots `rows` (a slice or an index tensor); `steps` [B] bool: rows whose state advances (None: all)."""
        fp, ip, f = self.fparams[rows], self.iparams[rows], self.frame[rows]
        seen = self.seen[rows]
        logits = penalize(F.linear(h, self.codec_head).float(), seen, fp[:, 0])
        logits = logits.masked_fill(self.suppress, float("-inf"))
        greedy = fp[:, 1] <= 0
        if sampled:
            at = f.clamp(max=self.length - 1)[:, None, None].expand(-1, 1, self.groups)
            u = self.uniforms[rows].gather(1, at)[:, 0]                        # [B, G]
            code0 = sample(logits, u[:, 0], fp[:, 1], ip[:, 0], fp[:, 2], greedy)
        else:
            code0 = logits.argmax(-1)
        status = torch.where(code0 == self.eos, EOS, torch.where(f + 1 >= ip[:, 1], LENGTH, GOING))
        # state updates last: with `rows` a slice, fp / ip / f / seen are views of the state
        go = torch.ones_like(code0, dtype=torch.bool) if steps is None else steps
        chosen = seen.gather(1, code0[:, None]) | go[:, None]
        self.seen[rows] = seen.scatter(1, code0[:, None], chosen)
        self.frame[rows] = f + go
        codes, codec = self.residual(h, code0, u if sampled else None, greedy)
        self.codec_next[rows] = codec if steps is None else torch.where(go[:, None], codec, self.codec_next[rows])
        return torch.cat([codes, status[:, None]], dim=1)

    def residual(self, h: torch.Tensor, code0: torch.Tensor, u: torch.Tensor | None, greedy: torch.Tensor):
        """The code predictor: (codes [B, G] with code 0 first, the sum of their embeddings [B, H])."""
        first = F.embedding(code0, self.codec_embed)
        codes, embeds = [code0], [first]
        hidden = self.cp.first(torch.stack([h, first], dim=1))
        for g in range(1, self.groups):
            logits = F.linear(hidden, self.cp_heads[g - 1]).float()
            code = logits.argmax(-1) if u is None else sample(
                logits, u[:, g], RESIDUAL.temperature, RESIDUAL.top_k, RESIDUAL.top_p, greedy)
            e = F.embedding(code, self.cp_embed[g - 1])
            codes.append(code)
            embeds.append(e)
            if g < self.groups - 1:
                hidden = self.cp.next(e, g + 1)
        # one reduction over the 16 rows, as transformers sums them (order matters in float)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(1)

    def to_host(self, out: torch.Tensor):
        """The step's one device-to-host copy -> a numpy array [rows, 17] (valid until the next step)."""
        if out.device.type != "cuda":
            return out.numpy()
        m = out.shape[0]
        self.host_out[:m].copy_(out, non_blocking=True)
        torch.cuda.current_stream(out.device).synchronize()
        return self.host_out[:m].numpy()
