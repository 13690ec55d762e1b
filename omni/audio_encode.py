"""Compressed audio out (mp3, flac, Ogg Opus, AAC in ADTS) with PyAV, whose wheels carry FFmpeg and its
encoders: float32 mono samples in, file bytes out, whole or as they are made.

Each format here is a container a client can read from its first byte on (no index at the end), so a
stream is the file's bytes in order. A whole file is written to a seekable buffer instead, where the mp3
muxer adds its Xing/LAME header (the length and encoder delay: players trim the padding) and FLAC's
STREAMINFO gets its sample count; a stream has neither (a decoder reads up to a frame of padding more).
"""

from __future__ import annotations

import io
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np


class Format(NamedTuple):
    container: str
    codec: str
    content_type: str
    bit_rate: int | None      # None: lossless


# OpenAI's speech / chat names. 64 kb/s mono is transparent enough for speech in each lossy codec.
FORMATS = {
    "mp3": Format("mp3", "libmp3lame", "audio/mpeg", 64000),
    "flac": Format("flac", "flac", "audio/flac", None),
    "opus": Format("ogg", "libopus", "audio/ogg", 64000),
    "aac": Format("adts", "aac", "audio/aac", 64000),
}
# Fewer samples (but some) than this are padded with silence at close: a few samples made an empty
# file (Opus through the resampler, mp3 above 48 kHz) or an undecodable one (AAC, 1-2 samples).
MIN_SAMPLES = 4096
# Ogg keeps packets until a page holds this much (µs; FFmpeg's default 1 s): a stream's bytes leave sooner.
OGG_PAGE_US = 100_000


def encoded_rate(codec: Any, rate: int) -> int:
    """The rate `codec` encodes `rate` at: itself where taken (FLAC takes any), else the lowest taken rate
    above it (Piper's 22050 Hz is 24000 Hz in Opus, which takes 8/12/16/24/48 kHz), else the highest."""
    rates = codec.audio_rates
    if not rates or rate in rates:
        return rate
    above = [r for r in rates if r > rate]
    return min(above) if above else max(rates)


class _Sink:
    """A write-only, unseekable file: what the muxer wrote since the last take()."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, b) -> int:
        self.parts.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class Encoder:
    """One file of `fmt` from float32 mono samples at `sample_rate`. write() returns the bytes made so far
    (often b"": encoders hold a frame back), close() the rest. PyAV re-chunks the samples into the codec's
    frames, converts their sample format and resamples (FFmpeg's swresample) where the codec wants
    another rate; `rate` is the rate of the file. write() and close() may run on threads: one at a time (a
    stream cancelled while a write runs on a thread closes after it, not inside it)."""

    def __init__(self, fmt: str, sample_rate: int, out: Any = None):
        import av

        f = FORMATS[fmt]
        self._out = _Sink() if out is None else out
        options = {"page_duration": str(OGG_PAGE_US)} if f.container == "ogg" else {}
        if out is None:   # a stream: each packet's bytes leave the muxer at once
            options["flush_packets"] = "1"
        self._box = av.open(self._out, mode="w", format=f.container, container_options=options, buffer_size=4096)
        self.rate = encoded_rate(av.codec.Codec(f.codec, "w"), sample_rate)
        self._stream = self._box.add_stream(f.codec, rate=self.rate, layout="mono")
        if f.bit_rate:
            self._stream.bit_rate = f.bit_rate
        self._in_rate, self._pts, self._closed = sample_rate, 0, False
        self._lock = threading.Lock()
        # An open container collected with its file crashed the process (SIGSEGV in FFmpeg's write
        # callback): one dropped unclosed is closed first, its file still alive.
        self._finalizer = weakref.finalize(self, _close_box, self._box, self._out)

    def write(self, pcm_f32: Any) -> bytes:
        with self._lock:
            return self._write(pcm_f32)

    def _write(self, pcm_f32: Any) -> bytes:
        if self._closed:
            raise ValueError("write to a closed audio encoder")
        a = np.frombuffer(pcm_f32, "<f4") if isinstance(pcm_f32, (bytes, bytearray, memoryview)) else pcm_f32
        self._encode(np.clip(np.nan_to_num(np.asarray(a, np.float32).reshape(-1), nan=0.0), -1.0, 1.0))
        return self._take()

    def _encode(self, a: np.ndarray) -> None:
        import av

        if a.size:
            frame = av.AudioFrame.from_ndarray(a[None, :], format="flt", layout="mono")
            frame.sample_rate, frame.pts = self._in_rate, self._pts
            self._pts += a.size
            for packet in self._stream.encode(frame):
                self._box.mux(packet)

    def close(self) -> bytes:
        """The encoder's held-back frames and the container's trailer; closing twice is a no-op."""
        with self._lock:
            return self._close()

    def _close(self) -> bytes:
        if not self._closed:
            try:
                if 0 < self._pts < MIN_SAMPLES:
                    self._encode(np.zeros(MIN_SAMPLES - self._pts, np.float32))
                for packet in self._stream.encode(None):
                    self._box.mux(packet)
            finally:
                self._closed = True
                self._finalizer()
        return self._take()

    def _take(self) -> bytes:
        return self._out.take() if isinstance(self._out, _Sink) else b""


def encode(fmt: str, pcm_f32: Any, sample_rate: int) -> tuple[bytes, int]:
    """A whole file of `fmt` and its rate (see Encoder), written seekably for its length headers."""
    buf = io.BytesIO()
    enc = Encoder(fmt, sample_rate, out=buf)
    try:
        enc.write(pcm_f32)
    finally:
        enc.close()
    return buf.getvalue(), enc.rate


def _close_box(box: Any, out: Any) -> None:
    """Close an encoder's container while `out`, the file it writes to, is alive (finalize holds it)."""
    box.close()
