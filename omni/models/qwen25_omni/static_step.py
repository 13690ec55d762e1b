"""Qwen2.5-Omni's talker on the static step (omni/models/qwen3_omni/static_step.py, slots.py): one codebook,
no code predictor, and every text row made from the thinker's own row at that position.

Device: the shared slot state plus each slot's thinker rows [slots, max_model_len, H_thinker] (copied in
as pieces bring them), so a frame builds its rows on the device: reply(j) = row[n + j] + embed(g_j), or
the tts_eos / tts_pad row, then codec(previous code) + reply(j) through thinker_to_talker_proj, the dense
talker, codec_head, code 0 (codec bos suppressed, eos or pad ends). Inputs per row: what it reads
(0 text, 1 tts_eos, 2 tts_pad), the row index, the thinker id.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni.models.qwen25_omni import edges
from omni.models.qwen3_omni.layers import dense_stack
from omni.models.qwen3_omni.slots import IN_SLOT, SlotRunner, check_static_args, with_graphs
from omni.models.qwen3_omni.static_step import LENGTH, STOP, SlotState

TEXT, TTS_EOS, TTS_PAD = 0, 1, 2


class StaticTalker25(SlotState):
    def __init__(self, talker, embed: torch.Tensor, tts: tuple, suppress: torch.Tensor, stop_ids: list[int], *,
                 slots: int, max_model_len: int):
        c = talker.config
        if c.hidden_act != "silu":
            raise ValueError(f"the static talker step needs silu activations, the config has {c.hidden_act!r}")
        codec = talker.get_input_embeddings().weight                       # [vocab, H_thinker]
        super().__init__(slots=slots, length=max_model_len, vocab=c.vocab_size, hidden=codec.shape[1],
                         dtype=codec.dtype, device=embed.device, groups=1, inputs=3, suppress=suppress,
                         stop_ids=stop_ids)
        self.backbone = dense_stack(talker.model, slots, max_model_len)
        self.codec_embed, self.codec_head = codec, talker.codec_head.weight
        self.proj = (talker.thinker_to_talker_proj.weight, talker.thinker_to_talker_proj.bias)
        self.embed = embed
        self.tts = torch.stack([tts[1], tts[2]])                           # tts_eos, tts_pad rows
        self.rows = torch.zeros((slots, max_model_len, embed.shape[1]), dtype=embed.dtype, device=embed.device)
        self._slots = torch.arange(slots, device=embed.device)

    def put_rows(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """The thinker's rows start.. of the slot's request (those past max_model_len are never read)."""
        end = min(start + rows.shape[0], self.length)
        if end > start:
            self.rows[slot, start:end] = rows[:end - start]

    def move(self, src: int, dst: int) -> None:
        super().move(src, dst)
        self.rows[dst].copy_(self.rows[src])

    def decode(self, n: int, width: int, masked: bool, sampled: bool) -> torch.Tensor:
        kind, at, ids, steps = self.inputs[0, :n], self.inputs[1, :n], self.inputs[2, :n], self.inputs[3, :n]
        text = self.rows[self._slots[:n], at.clamp(max=self.length - 1)] + self.embed[ids]
        reply = torch.where((kind == TEXT)[:, None], text, self.tts[(kind - 1).clamp(min=0)])
        x = F.linear(self.codec_next[:n] + reply, *self.proj)
        pos = self.pos[:n]
        h = self.backbone.decode(x, pos, width, self.attention_mask(pos, width, masked))
        pos.add_(steps)
        return self.frame_rows(h, slice(0, n), steps.bool(), sampled)

    def frame_rows(self, h: torch.Tensor, rows, steps: torch.Tensor | None, sampled: bool) -> torch.Tensor:
        code, status, _, _ = self.code0(F.linear(h, self.codec_head).float(), rows, steps, sampled)
        self.set_codec(rows, steps, F.embedding(code, self.codec_embed))
        return torch.stack([code, status], dim=1)


class Qwen25Slots(SlotRunner):
    def inputs(self, r) -> list[int]:
        kind, at, token = self.engine._next_text(r)
        return [kind, at, token]

    def prefill_rows(self, r) -> torch.Tensor:
        e = self.engine
        gen, _ = e._gen(r)
        return edges.prefill_rows(e.talker, e.embed, e.ids, r.prompt, gen[0], r.speaker_bos,
                                  e._rows(r)[:len(r.prompt) + 1], e.codec_rows)

    def admit(self, r, x: torch.Tensor, **extra) -> torch.Tensor:
        h = super().admit(r, x, seen=tuple(r.history))      # the prompt codes count for the penalty
        self.dev.put_rows(r.slot, 0, self.engine._rows(r))
        r.rows_in_slot = r.n_rows
        return h

    def apply(self, r, codes, status: int) -> None:
        if status == STOP:
            r.done = "stop"
            return
        r.frames.append(torch.from_numpy(codes.copy()))
        r.next_codec = IN_SLOT
        self.engine._stats["frames"] += 1
        if status == LENGTH:
            r.done = "length"     # the code that reached max_tokens is kept (transformers' count)


def static_runner25(engine, slots: int, max_model_len: int, enforce_eager: bool) -> Qwen25Slots:
    check_static_args(slots, max_model_len)
    with torch.no_grad():
        dev = StaticTalker25(engine.talker, engine.embed, engine._tts, engine._suppress, sorted(engine.stop_codes),
                             slots=slots, max_model_len=max_model_len)
    return with_graphs(Qwen25Slots(engine, dev), enforce_eager)
