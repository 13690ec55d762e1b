"""Stage processors for Qwen3-Omni (`fn(ctx, state, out) -> list[StageInput]`, see omni/processors.py).

thinker -> talker (`thinker_to_talker`): one continuing talker request, every piece
`stream=True` (the orchestrator closes it with an empty piece marked final).
  first piece: the thinker's prompt ids as it expanded them: the `prompt_token_ids` tensor
    (int64 [n]) of its first output, passed on as is, else (a thinker that does not expand)
    the request's own `prompt_token_ids` as `token_ids` (what the talker reads as
    `prompt_token_ids`). `voice` = the request's voice (default "ethan"); `generated_ids` =
    the thinker's first generated ids; a `mm_hidden` tensor on that output (the thinker's
    layer-k rows at the prompt's audio positions) is passed on. With audio in the prompt
    (`request.num_audio_inputs` > 0), the generated ids are held until an output carries
    `mm_hidden` (or the thinker finishes).
  later pieces: `generated_ids` = each output's generated ids (delta, including the
    thinker's EOS token when it stopped on it).
talker -> code2wav (`talker_to_code2wav`): each `codes` chunk as a streamed piece.
"""

from __future__ import annotations

from omni.processors import Context, StageInput, first_talker_piece
from omni.stage.messages import Output

DEFAULT_SPEAKER = "ethan"


def thinker_to_talker(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    ids = list(out.token_ids)
    if state.get("started"):
        return [StageInput(generated_ids=ids, stream=True)] if ids else []
    if ctx.request.num_audio_inputs and "mm_hidden" not in out.tensors and not out.finished:
        state.setdefault("held", []).extend(ids)    # the talker cannot prefill without those rows
        return []
    ids = state.pop("held", []) + ids
    state["started"] = True
    tensors = {k: out.tensors[k] for k in ("mm_hidden", "prompt_token_ids") if k in out.tensors}
    return [first_talker_piece(ctx, tensors, ids, DEFAULT_SPEAKER)]


def talker_to_code2wav(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    ref = out.tensors.get("codes")
    return [StageInput(tensors={"codes": ref}, stream=True)] if ref is not None else []
