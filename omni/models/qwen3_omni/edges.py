"""Thinker -> talker edge maths for ONE unpadded request (pure functions).

What transformers' `Qwen3OmniMoeForConditionalGeneration.generate()` builds for the
talker (`_get_talker_user_parts`, `_get_talker_assistant_parts` and the trailing
text / thinker-EOS handling), written for a single request so a stage can build it
from token ids as they stream in:

  prefill   = user rows + 9 assistant rows
  user rows = every prompt position inside a user turn (system turns dropped):
              text -> text_projection(embed(id)); audio/image/video placeholder ->
              hidden_projection(thinker layer-k hidden at that position)
  assistant = text_projection(embed(header 3 ids)), 4 x tts_pad, tts_bos,
              text_projection(embed(first text id)), each summed with the codec
              rows [0, 0, 0, nothink, think_bos, think_eos, speaker, pad, bos]
  trailing  = text_projection(embed(id)) for the text after the first one, cut
              after the thinker's first EOS token (kept), then tts_eos, then tts_pad
              for every further step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TalkerIds:
    im_start: int
    user: int
    assistant: int
    mm: tuple[int, ...]            # audio, image, video placeholder ids
    tts_bos: int
    tts_eos: int
    tts_pad: int
    codec_prefix: tuple[int, ...]  # nothink, think_bos, think_eos (speaker follows), then pad, bos
    codec_pad: int
    codec_bos: int
    codec_eos: int
    speakers: dict[str, int]

    @classmethod
    def from_config(cls, config) -> "TalkerIds":
        t = config.talker_config
        th = config.thinker_config
        return cls(
            im_start=config.im_start_token_id, user=config.user_token_id, assistant=config.assistant_token_id,
            mm=(th.audio_token_id, th.image_token_id, th.video_token_id),
            tts_bos=config.tts_bos_token_id, tts_eos=config.tts_eos_token_id, tts_pad=config.tts_pad_token_id,
            codec_prefix=(t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id),
            codec_pad=t.codec_pad_id, codec_bos=t.codec_bos_id, codec_eos=t.codec_eos_token_id,
            speakers={k.lower(): int(v) for k, v in dict(t.speaker_id).items()},
        )


def user_positions(prompt: list[int], ids: TalkerIds) -> list[int]:
    """Prompt positions whose turn (the role token after the latest <|im_start|>) is `user`.
    Before any <|im_start|> transformers looks at position 1; so does this."""
    n = len(prompt)
    out = []
    prev = 0
    for i, tok in enumerate(prompt):
        if tok == ids.im_start:
            prev = i
        if prompt[min(prev + 1, n - 1)] == ids.user:
            out.append(i)
    return out


def assistant_start(prompt: list[int], ids: TalkerIds) -> int:
    """Index of the last `<|im_start|>assistant` in the prompt."""
    for i in range(len(prompt) - 2, -1, -1):
        if prompt[i] == ids.im_start and prompt[i + 1] == ids.assistant:
            return i
    raise ValueError("the prompt has no '<|im_start|>assistant' header (build it with add_generation_prompt)")


def mm_positions(prompt: list[int], ids: TalkerIds) -> list[int]:
    return [i for i, tok in enumerate(prompt) if tok in ids.mm]


def on_device(values: list[int], device) -> torch.Tensor:
    """An int64 tensor of host values on `device`, copied without waiting for the device's queue."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def text_rows(talker, embed: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """text_projection(thinker embedding) for `token_ids` -> [n, H_talker]."""
    return talker.text_projection(embed[on_device(token_ids, embed.device)].unsqueeze(0))[0]


def tts_rows(talker, embed: torch.Tensor, ids: TalkerIds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tts_bos, tts_eos, tts_pad) rows, each [H_talker]."""
    rows = text_rows(talker, embed, [ids.tts_bos, ids.tts_eos, ids.tts_pad])
    return rows[0], rows[1], rows[2]


def prefill_embeds(talker, embed: torch.Tensor, ids: TalkerIds, prompt: list[int], first_text: int,
                   speaker_id: int, mm_hidden: torch.Tensor | None = None,
                   tts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The talker's prefill [L, H_talker] for one request.

    `prompt` is the thinker's prompt (placeholders expanded), ending with the
    assistant header; `first_text` the thinker's first generated id; `mm_hidden`
    the thinker's layer-k rows at every placeholder position of the prompt, in order.
    """
    a = assistant_start(prompt, ids)
    header = prompt[a:a + 3]
    if len(header) != 3 or a + 3 != len(prompt):
        raise ValueError(f"the prompt must end with the 3-token assistant header, "
                         f"found {len(prompt) - a} token(s) from '<|im_start|>assistant'")
    mm = mm_positions(prompt, ids)
    n_mm = 0 if mm_hidden is None else mm_hidden.shape[0]
    if n_mm != len(mm):
        raise ValueError(f"the prompt has {len(mm)} audio/image/video placeholder(s) "
                         f"but {n_mm} hidden row(s) came with it")
    users = user_positions(prompt, ids)
    mm_row = {p: r for r, p in enumerate(mm)}
    parts = []
    text_pos = [p for p in users if p not in mm_row]
    user = torch.empty(len(users), talker.config.text_config.hidden_size, dtype=embed.dtype,
                       device=embed.device)
    # index lists built on the host: a boolean mask would make the device report its count back
    mm_at = [i for i, p in enumerate(users) if p in mm_row]
    if text_pos:
        text_at = [i for i, p in enumerate(users) if p not in mm_row]
        user[on_device(text_at, embed.device)] = text_rows(talker, embed, [prompt[p] for p in text_pos])
    if mm_at:
        rows = mm_hidden[on_device([mm_row[users[i]] for i in mm_at], mm_hidden.device)].to(embed.device, embed.dtype)
        user[on_device(mm_at, embed.device)] = talker.hidden_projection(rows.unsqueeze(0))[0]
    parts.append(user)
    tts_bos, _, tts_pad = tts if tts is not None else tts_rows(talker, embed, ids)
    assistant = text_rows(talker, embed, header + [first_text])
    text = torch.cat([assistant[:3], tts_pad.expand(4, -1), tts_bos[None], assistant[3:4]])
    codec_ids = list(ids.codec_prefix) + [speaker_id, ids.codec_pad, ids.codec_bos]
    codec = talker.get_input_embeddings()(on_device(codec_ids, embed.device))
    codec = torch.cat([codec.new_zeros(3, codec.shape[1]), codec])
    parts.append(text + codec)
    return torch.cat(parts)


def trailing_ids(generated: list[int], eos_ids: set[int]) -> tuple[list[int], bool]:
    """(text ids the talker consumes after the first one, whether the thinker's EOS was seen).
    Cut after the first EOS (the EOS id itself stays: transformers feeds it too)."""
    for i, tok in enumerate(generated):
        if tok in eos_ids:
            return generated[1:i + 1], True
    return generated[1:], False
