"""Qwen-Image's stage processors: an AR stage writes the prompt the DiT renders."""

from __future__ import annotations

from omni.processors import Context, StageInput
from omni.stage.messages import Output


def lm_to_dit(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    """The LM's ids gather as they stream in; when the LM finishes, the DiT gets their text with the
    client's image parameters. Nothing goes earlier: the DiT's text encoder reads the whole prompt at
    once, and the text is decoded whole (a byte-level token may end inside a character). An LM that
    writes only whitespace leaves the client's own prompt."""
    ids = state.setdefault("ids", [])
    ids.extend(out.token_ids)
    if not out.finished:
        return []
    text = ctx.detokenize(ids).strip() or ctx.request.text or ""
    return [StageInput(text=text, image=ctx.request.image)]
