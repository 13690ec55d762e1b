"""Thinker -> talker edge maths for ONE unpadded request (pure functions).

What transformers' `Qwen2_5OmniForConditionalGeneration.generate()` feeds its talker,
for a single request. Unlike Qwen3-Omni, every row (text included) needs the thinker's
final-normed last-layer hidden state `h` (the rows its lm_head reads) at that position:

  prefill  = [embed(id) + h for every prompt position (embed 0 at audio/image/video
              placeholders), embed(speaker's text bos), embed(g0) + h(g0)]
             The talker's forward would add the codec pad / bos embeddings to the last two rows,
             but only when it gets an attention_mask, and transformers 5.19's generate() passes
             none: its reference omits them. `codec_rows=True` adds them (the original Qwen code).
  step j   = codec(previous code) + reply(j), j = 1, 2, ...
  reply(j) = embed(g_j) + h(g_j) while j < p, embed(tts_eos) at j == p, embed(tts_pad) after,
             p = the index of the thinker's first EOS (at least 1), or len(generated) - 1
             without one: the thinker's last token was never fed, so it has no row.
Every row goes through the talker's `thinker_to_talker_proj` before its layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni.models.qwen3_omni.edges import on_device


@dataclass(frozen=True)
class TalkerIds:
    mm: tuple[int, ...]            # audio, image, video placeholder ids
    tts_bos: int
    tts_eos: int
    tts_pad: int
    codec_bos: int
    codec_eos: int
    codec_pad: int
    codec_mask: int

    @classmethod
    def from_config(cls, config) -> "TalkerIds":
        t = config.talker_config
        th = config.thinker_config
        return cls(mm=(th.audio_token_index, th.image_token_index, th.video_token_index),
                   tts_bos=t.tts_text_start_token_id, tts_eos=t.tts_text_end_token_id,
                   tts_pad=t.tts_text_pad_token_id, codec_bos=t.tts_codec_start_token_id,
                   codec_eos=t.tts_codec_end_token_id, codec_pad=t.tts_codec_pad_token_id,
                   codec_mask=t.tts_codec_mask_token_id)


def prefill_rows(talker, embed: torch.Tensor, ids: TalkerIds, prompt: list[int], first: int, speaker_bos: int,
                 hidden: torch.Tensor, codec_rows: bool = False) -> torch.Tensor:
    """The talker's prefill input [len(prompt) + 2, H_talker] (after thinker_to_talker_proj).
    `hidden` holds the thinker's rows for the prompt and the first generated id (>= len(prompt) + 1)."""
    n = len(prompt)
    if hidden.shape[0] < n + 1:
        raise ValueError(f"the talker's prefill needs {n + 1} thinker rows (prompt + first token), "
                         f"got {hidden.shape[0]}")
    x = embed[on_device(prompt + [speaker_bos, first], embed.device)]
    mm = [i for i, t in enumerate(prompt) if t in ids.mm]    # host-side: a mask would read back its count
    if mm:
        x[on_device(mm, embed.device)] = 0.0        # placeholders carry only the thinker's row
    rows = hidden[:n + 1].to(embed.device, embed.dtype)
    x = torch.cat([rows[:n] + x[:n], x[n:n + 1], rows[n:n + 1] + x[n + 1:]])
    if codec_rows:
        x[-2:] += talker.get_input_embeddings()(on_device([ids.codec_pad, ids.codec_bos], embed.device))
    return talker.thinker_to_talker_proj(x)


def reply_index(generated: list[int], eos_ids: set[int], final: bool) -> int | None:
    """p: the first reply index that is no longer the thinker's text (tts_eos there, tts_pad after);
    None while the thinker may still add text."""
    for i, tok in enumerate(generated):
        if tok in eos_ids:
            return max(i, 1)
    return max(len(generated) - 1, 1) if final else None
