"""Rendering of per-token logprobs in OpenAI's two shapes (chat and legacy completions), as
vLLM's server renders them: each token detokenized alone, logprobs clamped at -9999.0 (what
OpenAI sends for -inf, which JSON cannot carry), `bytes` the UTF-8 of that text.

An entry is (sampled token id, its logprob, [(token id, logprob)] best first); Generation
collects them from the text outputs (omni/api/generation.py).
"""

from __future__ import annotations

from typing import Any

Entry = tuple[int, float, list[tuple[int, float]]]

_FLOOR = -9999.0
_SPACE_MARKER = "\u2581"   # sentencepiece's space


def token_strings(tokenizer: Any, ids: list[int]) -> dict[int, str]:
    """Each id decoded on its own (special tokens kept). Sentencepiece decoders drop the leading
    space of a lone token; vLLM puts it back from the vocabulary piece, and so do we."""
    uniq = list(dict.fromkeys(ids))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        texts = backend.decode_batch([[t] for t in uniq], skip_special_tokens=False)
    else:
        texts = [tokenizer.decode([t]) for t in uniq]
    pieces = tokenizer.convert_ids_to_tokens(uniq)
    out = {}
    for t, text, piece in zip(uniq, texts, pieces):
        if piece and piece.startswith(_SPACE_MARKER) and not text.startswith(" "):
            text = " " + text
        out[t] = text or ""
    return out


def _strings(tokenizer: Any, entries: list[Entry]) -> dict[int, str]:
    return token_strings(tokenizer, [i for tok, _, top in entries for i in (tok, *(t for t, _ in top))])


def _one(s: str, lp: float) -> dict:
    return {"token": s, "logprob": max(lp, _FLOOR), "bytes": list(s.encode("utf-8", errors="replace"))}


def chat(tokenizer: Any, entries: list[Entry]) -> dict:
    """`choices[].logprobs` of a chat completion (or of one chunk)."""
    strs = _strings(tokenizer, entries)
    return {"content": [{**_one(strs[tok], lp), "top_logprobs": [_one(strs[t], v) for t, v in top]}
                        for tok, lp, top in entries]}


def completion(tokenizer: Any, entries: list[Entry], offset: int = 0) -> dict:
    """`choices[].logprobs` of a completion: `top_logprobs` maps the sampled token and the top k
    (so up to k + 1 entries, as OpenAI documents); `text_offset` counts from `offset` (the text
    already sent, in a stream) by each token's own text."""
    strs = _strings(tokenizer, entries)
    tokens, lps, tops, offsets = [], [], [], []
    for tok, lp, top in entries:
        tokens.append(strs[tok])
        lps.append(max(lp, _FLOOR))
        tops.append({strs[t]: max(v, _FLOOR) for t, v in [(tok, lp), *top]})
        offsets.append(offset)
        offset += len(strs[tok])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
