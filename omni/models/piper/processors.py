"""Stage processors of the Piper pipeline (thinker -> talker -> code2wav; see omni/processors.py).

thinker -> talker: one talker sub-request per sentence, sent as soon as the sentence ends, in the
request's voice and speed. talker -> code2wav: each sentence's latents as a streamed piece, so code2wav
starts on the first sentence while the next is spoken.
"""

from __future__ import annotations

import re

from omni.processors import Context, StageInput
from omni.stage.messages import Output

SENTENCE_END = re.compile(r"[.!?;:\n]+[\"')\]]*\s+")


def thinker_to_talker(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    """Thinker tokens -> one talker sub-request per sentence, as soon as it ends."""
    ids = state.setdefault("ids", [])
    ids.extend(out.token_ids)
    text = ctx.detokenize(ids)
    sent = state.get("sent_chars", 0)
    pieces = []
    pending = text[sent:]
    while True:
        match = SENTENCE_END.search(pending)
        if not match:
            break
        pieces.append(pending[: match.end()])
        sent += match.end()
        pending = pending[match.end():]
    if out.finished and pending.strip():
        pieces.append(pending)
        sent += len(pending)
    state["sent_chars"] = sent
    inputs = []
    for piece in pieces:
        if piece.strip():
            n = state["n"] = state.get("n", 0) + 1
            inputs.append(StageInput(text=piece.strip(), voice=ctx.request.voice, speed=ctx.request.speed,
                                     sub_id=f"s{n}"))
    return inputs


def talker_to_code2wav(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    # Streamed: code2wav starts decoding the first sentence while the next is spoken.
    ref = out.tensors.get("latents")
    return [StageInput(tensors={"latents": ref}, stream=True)] if ref is not None else []
