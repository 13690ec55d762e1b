"""Stage processors for Qwen3-Omni (`fn(ctx, state, out) -> list[StageInput]`, see omni/processors.py).

thinker -> talker (`thinker_to_talker`): one continuing talker request, every piece
`stream=True` (the orchestrator closes it with an empty piece marked final).
  first piece: `token_ids` = the thinker's prompt ids (what the talker engine reads as
    `prompt_token_ids`), taken from `ctx.request_extra["prompt_token_ids"]`; else the
    thinker's first output must carry a `prompt_token_ids` tensor (int64 [n]), passed on
    as is. `extra["speaker"]` = `ctx.request_extra["voice"]` (default "ethan");
    `extra["token_ids"]` = the thinker's first generated ids; a `mm_hidden` tensor on
    that output (the thinker's layer-k rows at the prompt's audio positions) is passed on.
    With `ctx.request_extra["num_audio_inputs"]` > 0 (the prompt has audio), the
    generated ids are held until an output carries `mm_hidden` (or the thinker finishes).
  later pieces: `extra["token_ids"]` = each output's generated ids (delta, including
    the thinker's EOS token when it stopped on it).
talker -> code2wav (`talker_to_code2wav`): each `codes` chunk as a streamed piece.
"""

from __future__ import annotations

from omni.processors import Context, StageInput
from omni.stage.messages import Output

DEFAULT_SPEAKER = "ethan"


def thinker_to_talker(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    ids = list(out.token_ids)
    if state.get("started"):
        return [StageInput(extra={"token_ids": ids}, stream=True)] if ids else []
    expect_rows = ctx.request_extra.get("mm_hidden_expected") or ctx.request_extra.get("num_audio_inputs")
    if expect_rows and "mm_hidden" not in out.tensors and not out.finished:
        state.setdefault("held", []).extend(ids)    # the talker cannot prefill without those rows
        return []
    ids = state.pop("held", []) + ids
    state["started"] = True
    extra = {"speaker": ctx.request_extra.get("voice") or DEFAULT_SPEAKER, "token_ids": ids}
    tensors = {k: out.tensors[k] for k in ("mm_hidden",) if k in out.tensors}
    prompt = ctx.request_extra.get("prompt_token_ids")
    if prompt is None and "prompt_token_ids" in out.tensors:
        tensors["prompt_token_ids"] = out.tensors["prompt_token_ids"]
    return [StageInput(token_ids=list(prompt) if prompt is not None else None, tensors=tensors,
                       extra=extra, stream=True)]


def talker_to_code2wav(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    ref = out.tensors.get("codes")
    return [StageInput(tensors={"codes": ref}, stream=True)] if ref is not None else []
