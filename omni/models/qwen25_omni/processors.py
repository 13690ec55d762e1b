"""Stage processors for Qwen2.5-Omni (`fn(ctx, state, out) -> list[StageInput]`, see omni/processors.py).

thinker -> talker (`thinker_to_talker`): one continuing talker request, every piece
`stream=True` (the orchestrator closes it with an empty piece marked final).
  first piece: the prompt, voice (default "Chelsie") and generated ids as for Qwen3-Omni
    (`omni.processors.first_talker_piece`).
  every piece: the output's `thinker_hidden` tensor (the thinker's final-normed last-layer rows
    for the positions that step computed: the prompt's with the first output, then one per
    fed id) passed on, or `thinker_last_layer` (the same rows before the final norm); the vLLM
    engine's `hidden_rows` (with `hidden_rows_layer: last`: those pre-norm rows) goes on as
    `thinker_last_layer`. Later pieces carry `generated_ids` = the new ids.
talker -> token2wav (`talker_to_token2wav`): each `codes` chunk as a streamed piece; the
  first names the voice (token2wav conditions on it; the seed comes with the request's sampling).
"""

from __future__ import annotations

from omni.processors import Context, StageInput, first_talker_piece
from omni.stage.messages import Output

DEFAULT_SPEAKER = "Chelsie"


def thinker_to_talker(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    ids = list(out.token_ids)
    tensors = {k: out.tensors[k] for k in ("thinker_hidden", "thinker_last_layer") if k in out.tensors}
    if "hidden_rows" in out.tensors:
        tensors["thinker_last_layer"] = out.tensors["hidden_rows"]
    if state.get("started"):
        return [StageInput(generated_ids=ids, tensors=tensors, stream=True)] if ids or tensors else []
    state["started"] = True
    if "prompt_token_ids" in out.tensors:
        tensors["prompt_token_ids"] = out.tensors["prompt_token_ids"]
    return [first_talker_piece(ctx, tensors, ids, DEFAULT_SPEAKER)]


def talker_to_token2wav(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    ref = out.tensors.get("codes")
    if ref is None:
        return []
    voice = None
    if not state.get("started"):
        state["started"] = True
        voice = ctx.request.voice or DEFAULT_SPEAKER
    return [StageInput(tensors={"codes": ref}, voice=voice, stream=True)]
