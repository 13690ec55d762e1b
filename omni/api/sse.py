"""Server-sent events framing for the streaming routes."""

from __future__ import annotations

import msgspec


class Last(bytes):
    """A stream's closing event ([DONE], speech.audio.done or .error): once it went out the stream is
    whole, so a server stop ends it as it is (http.ClosingStream) rather than adding an error after it."""


DONE = Last(b"data: [DONE]\n\n")
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_enc = msgspec.json.Encoder()


def event(obj: dict) -> bytes:
    """One `data: {json}` event. JSON never contains a raw newline, so one line is enough."""
    return b"data: " + _enc.encode(obj) + b"\n\n"
