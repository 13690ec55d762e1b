"""Incremental detokenization and stop-string handling for streamed token ids.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and
sentencepiece-style tokenizers drop a leading space when a window is decoded on
its own. So each step decodes a short window that starts a few tokens back (the
"prefix"), and emits only the text after the prefix's own decoding; a window
whose text ends in U+FFFD is held back until the character completes (vLLM's
prefix/read offset scheme, written here from the idea).
"""

from __future__ import annotations

from typing import Any, Callable

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


def decoder_for(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """A thread-safe ids -> text function: the Rust backend when present (no Python-side state)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_tail: list[int] = ()):
        self._decode = decode
        self._ids: list[int] = list(prompt_tail)[-_CONTEXT_TOKENS:]
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""  # everything emitted so far

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the newly complete text (maybe "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: emit whatever is held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        window_text = self._decode(self._ids[self._prefix:])
        if len(window_text) <= len(prefix_text) and not final:
            return ""  # e.g. a lone byte that is not yet a character
        if window_text.endswith(_REPLACEMENT) and not final:
            return ""
        delta = window_text[len(prefix_text):]
        # The emitted tokens become the next prefix (at most a few of them, for context).
        self._prefix = max(self._read, len(self._ids) - _CONTEXT_TOKENS)
        self._read = len(self._ids)
        # Keep the window small: drop ids before the prefix.
        if self._prefix > 0:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that could start one.

    As vLLM: with `include` the stop string stays at the end of the text; text fed while not
    `armed` (the request's min_tokens not yet passed) cannot complete a match, though a stop
    string that starts there and ends in later text does."""

    def __init__(self, stops: list[str], include: bool = False):
        self._stops = [s for s in stops if s]
        self._include = include
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self._armed_at = 0        # where in _pending the text fed while armed starts
        self.stopped = False
        self.matched: str | None = None   # the stop string found (vLLM's stop_reason)

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, delta: str, armed: bool = True) -> str:
        """Return the text safe to emit now; sets `stopped` when a stop string appeared."""
        if not self._stops:
            return delta
        if self.stopped:
            return ""
        if not armed:
            self._armed_at = len(self._pending) + len(delta)
        self._pending += delta
        # As vLLM's check_stop_strings: the match that ends earliest; the first listed on a tie.
        found = [(i + len(s), k, i, s) for k, s in enumerate(self._stops) if (i := self._find(s)) >= 0]
        if found:
            end, _, cut, self.matched = min(found)
            self.stopped = True
            end = end if self._include else cut
            out, self._pending = self._pending[:end], ""
            return out
        if len(self._pending) <= self._hold:
            return ""
        out = self._pending[:len(self._pending) - self._hold]
        self._pending = self._pending[len(out):]
        self._armed_at = max(0, self._armed_at - len(out))
        return out

    def _find(self, stop: str) -> int:
        """The first match that ends in text fed while armed, or -1."""
        return self._pending.find(stop, max(0, self._armed_at - len(stop) + 1))

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
