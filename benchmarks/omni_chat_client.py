"""A chat-with-audio client in the format of vllm-omni's benchmark client (`vllm bench serve --omni`,
backend `openai-chat-omni`), written here from its documented behaviour (no code of it).

What that backend does, and so this client: it posts a streaming chat request (text parts,
temperature 0, `max_tokens`, `stream_options` with `include_usage` and `continuous_usage_stats`,
the extra body's `modalities`; no `audio` object); splits the SSE body into messages at blank
lines (a trailing message that is already whole JSON counts too), skips `:` comments and
`[DONE]`; for each chunk with choices reads the chunk's top-level `modality`: "text" chunks count
tokens (from the usage's completion_tokens, else token_ids, else one per non-empty content) for
TTFT; "audio" chunks take `delta.content`, else `delta.audio.data`, as base64, the first one's time
is the time to first audio (TTFA, its "audio_ttfp"), the last one's the audio generation time, and
with the payload's `response_format` absent or "wav" each chunk must be a whole WAV file whose
frames are kept (chunks whose channels, width or rate differ from the first are dropped). Then
audio duration = frames / rate and RTF = generation time / duration.
"""

from __future__ import annotations

import base64
import codecs
import io
import json
import time
import wave
from dataclasses import dataclass, field

import httpx


def payload(model: str, prompt: str, max_tokens: int, extra_body: dict | None = None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "temperature": 0.0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update(extra_body or {})
    return body


class SSEMessages:
    """Bytes in, whole SSE messages out (text between blank lines, stripped)."""

    def __init__(self) -> None:
        self._pending = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")()   # a character may span two reads

    def feed(self, data: bytes) -> list[str]:
        *whole, self._pending = (self._pending + self._utf8.decode(data)).split("\n\n")
        out = [m.strip() for m in whole if m.strip()]
        tail = self._pending.removeprefix("data: ").strip()
        if self._pending.startswith("data: ") and tail and (tail == "[DONE]" or _is_json(tail)):
            out.append(self._pending.strip())
            self._pending = ""
        return out


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0                 # seconds from the request to the first text token, 0 if none
    audio_ttfp: float = 0.0           # seconds to the first audio chunk, 0 if none
    audio_generate_time: float = 0.0  # seconds to the last audio chunk
    latency: float = 0.0              # seconds to the last chunk
    audio_frames: int = 0
    audio_duration: float = 0.0
    audio_rtf: float = 0.0
    sample_rate: int = 0
    output_tokens: int = 0
    text: str = ""
    pcm: bytes = b""                  # the joined frames (wav mode) or the joined payloads (others)
    itl: list[float] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    dropped_chunks: int = 0


class StreamParse:
    """One response's chunks as the backend reads them; times come from the caller."""

    def __init__(self, start: float, response_format: str = "wav"):
        self.r = Result(start=start)
        self.wav = response_format == "wav"
        self._params: tuple[int, int, int] | None = None
        self._frames = bytearray()
        self._tokens_seen = 0
        self._last = start

    def message(self, msg: str, now: float) -> None:
        if msg.startswith(":"):
            return
        chunk = msg.removeprefix("data: ")
        if chunk == "[DONE]":
            return
        r = self.r
        r.latency = now - r.start
        data = json.loads(chunk)
        if isinstance(data.get("error"), dict):
            r.error = str(data["error"].get("message"))    # the backend ignores it; a benchmark should not
        usage = data.get("usage")
        completion = None
        if isinstance(usage, dict):
            r.usage = usage
            ct = usage.get("completion_tokens")
            if isinstance(ct, int) and ct > 0:
                completion = ct
                r.output_tokens = max(r.output_tokens, ct)
        choices = data.get("choices")
        if not choices:
            return
        choice = choices[0]
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if not content and isinstance(delta.get("audio"), dict):
            content = delta["audio"].get("data")
        modality = data.get("modality")
        if modality == "text":
            self._text(now, completion, choice.get("token_ids"), content)
        elif modality == "audio":
            self._audio(now, content)

    def _text(self, now: float, completion: int | None, token_ids, content) -> None:
        n = 0
        if completion is not None and completion > self._tokens_seen:
            n, self._tokens_seen = completion - self._tokens_seen, completion
        elif token_ids:
            n = len(token_ids)
            self._tokens_seen = max(self._tokens_seen, completion or 0)
        elif content and completion is None:
            n = 1
        if n:
            if not self.r.ttft:
                self.r.ttft = now - self.r.start
                self.r.itl += [0.0] * (n - 1)
            else:
                self.r.itl += [max(now - self._last, 0.0) / n] * n
            self._last = now
        if content:
            self.r.text += content

    def _audio(self, now: float, content) -> None:
        r = self.r
        if not r.audio_ttfp:
            r.audio_ttfp = now - r.start
        r.audio_generate_time = now - r.start
        if not content:
            return
        blob = base64.b64decode(content)
        if not self.wav:
            self._frames += blob
            return
        try:
            with wave.open(io.BytesIO(blob), "rb") as w:
                params = (w.getnchannels(), w.getsampwidth(), w.getframerate())
                frames = w.readframes(w.getnframes())
        except (wave.Error, EOFError):
            r.dropped_chunks += 1     # the backend logs a warning and goes on
            return
        if self._params is None:
            self._params = params
        if params != self._params:
            r.dropped_chunks += 1
            return
        self._frames += frames

    def finish(self) -> Result:
        r = self.r
        r.pcm = bytes(self._frames)
        if self.wav and self._params is not None:
            channels, width, rate = self._params
            r.sample_rate = rate
            r.audio_frames = len(self._frames) // (channels * width)
            r.audio_duration = r.audio_frames / rate
        if r.audio_duration > 0:
            r.audio_rtf = r.audio_generate_time / r.audio_duration
        r.ok = not r.error
        return r


async def chat(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    """POST one streaming chat request at `url` (…/v1/chat/completions) and parse its stream."""
    start = time.perf_counter()
    p = StreamParse(start, body.get("response_format", "wav"))
    sse = SSEMessages()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                r = Result(start=start, error=f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
                return r
            async for data in resp.aiter_raw():
                for msg in sse.feed(data):
                    p.message(msg, time.perf_counter())
    except (httpx.HTTPError, ValueError) as e:
        return Result(start=start, error=f"{type(e).__name__}: {e}")
    return p.finish()
