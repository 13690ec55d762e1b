"""Waveform encoding: float32 samples in [-1, 1] -> 16-bit PCM / WAV bytes."""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import numpy as np

# Data size to put in a header whose length is not known yet (streamed WAV):
# players read until EOF.
STREAMING_SIZE = 0xFFFFFFFF


def _as_mono_f32(pcm: Any) -> np.ndarray:
    if hasattr(pcm, "detach"):      # a torch tensor, without importing torch
        pcm = pcm.detach().cpu().numpy()
    a = np.asarray(pcm)
    if a.dtype.kind != "f":
        raise ValueError(f"expected float samples in [-1, 1], got dtype {a.dtype}")
    if a.ndim > 1 and a.size == max(a.shape):   # [1, 1, N] and the like
        a = a.reshape(-1)
    if a.ndim != 1:
        raise ValueError(f"expected mono samples (one dimension), got shape {a.shape}")
    return a


def pcm16_bytes(pcm_f32: Any) -> bytes:
    """Little-endian signed 16-bit samples; values outside [-1, 1] are clipped."""
    a = _as_mono_f32(pcm_f32)
    a = np.nan_to_num(a, nan=0.0, posinf=1.0, neginf=-1.0)
    return (np.clip(a, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, num_samples: int | None = None) -> bytes:
    """A 44-byte mono 16-bit PCM RIFF header; num_samples=None for a stream."""
    if not isinstance(sample_rate, int) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive int, got {sample_rate!r}")
    if num_samples is None:
        data_size, riff_size = STREAMING_SIZE, STREAMING_SIZE
    else:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        data_size = 2 * num_samples
        riff_size = 36 + data_size
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16)
            + b"data" + struct.pack("<I", data_size))


def wav_bytes(pcm_f32: Any, sample_rate: int) -> bytes:
    """A complete mono 16-bit PCM WAV file."""
    data = pcm16_bytes(pcm_f32)
    return wav_header(sample_rate, len(data) // 2) + data


# ---------------------------------------------------------------- decoding (audio input)

_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
# Sample rates taken: a header's rate is any u32, and resampling from 4 GHz costs millions of taps
# per output sample (gigabytes for one request).
MIN_RATE, MAX_RATE = 1000, 384000
# A WAV's rate is a multiple of this (8000, 11025, 22050, 44100, 48000, 352800 ... all are), so its ratio to
# 16 kHz (AUDIO_IN_RATE) reduces to at most 640 filter phases: the weights fit one block, stay cached and cost
# milliseconds. A coprime rate such as 383999 Hz has 16000 phases, 50 MB of weights evaluated again for each
# part (0.2-0.65 s of CPU above ~127 kHz); no recorder writes one.
RATE_STEP = 25
# Filter-matrix elements per resampling block (a few MB per working array at any ratio).
BLOCK_ELEMS = 1 << 20


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A RIFF/WAVE file -> (float32 mono samples in [-1, 1], sample rate). Integer PCM (8/16/24/32
    bit) and IEEE float (32/64 bit), any channel count (averaged). ValueError names what is wrong."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a WAV file (no RIFF/WAVE header)")
    fmt = None
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            if len(body) < 16:
                raise ValueError("WAV fmt chunk is too short")
            tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
            if tag == _EXTENSIBLE and len(body) >= 26:
                tag = struct.unpack_from("<H", body, 24)[0]
            fmt = (tag, channels, rate, bits)
        elif cid == b"data":
            if fmt is None:
                raise ValueError("WAV data chunk comes before its fmt chunk")
            return _decode_samples(body, *fmt)
        pos += 8 + size + (size & 1)
    raise ValueError("WAV file has no data chunk")


def _decode_samples(body: bytes, tag: int, channels: int, rate: int, bits: int) -> tuple[np.ndarray, int]:
    if channels < 1:
        raise ValueError(f"WAV header says {channels} channels at {rate} Hz")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"WAV sample rate {rate} Hz is outside {MIN_RATE}..{MAX_RATE} Hz")
    if rate % RATE_STEP:
        raise ValueError(f"WAV sample rate {rate} Hz is not a multiple of {RATE_STEP} Hz (as 8000, 16000, 22050, "
                         f"44100 and 48000 are): resample it to a standard rate")
    width = bits // 8
    usable = len(body) - len(body) % (width * channels) if width else 0
    body = body[:usable]
    if tag == _PCM and bits == 8:
        a = (np.frombuffer(body, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == _PCM and bits in (16, 32):
        a = np.frombuffer(body, f"<i{width}").astype(np.float32) / float(2 ** (bits - 1))
    elif tag == _PCM and bits == 24:
        b = np.frombuffer(body, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        a = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif tag == _FLOAT and bits in (32, 64):
        a = np.frombuffer(body, f"<f{width}").astype(np.float32)
    else:
        raise ValueError(f"WAV encoding (format tag {tag}, {bits} bits) is not supported: "
                         "use integer PCM or 32/64-bit float")
    a = a.reshape(-1, channels).mean(axis=1) if channels > 1 else a
    if not np.isfinite(a).all():
        raise ValueError("WAV samples are not finite")
    return np.ascontiguousarray(a, dtype=np.float32), rate


def resample(x: np.ndarray, rate_in: int, rate_out: int, half_taps: int = 16) -> np.ndarray:
    """Band-limited resampling (Hann-windowed sinc, cut off below the lower Nyquist), polyphase: with
    rate_out / rate_in = L / M in lowest terms, output n sits at input instant n*M/L, whose fraction
    takes L values (phases), so the outputs n = r, r + L, ... share one set of weights. Each phase's
    weights are evaluated once (never more points than the outputs' taps), many phases per numpy call
    (L is up to 16000 at coprime rates: a Python step per phase cost 0.2 s for a one-second part), and
    kept for the next part at the same rates where the table fits the cache's 4 blocks (a coprime rate
    above ~127 kHz does not: 0.2-0.65 s of CPU each part; read_wav takes only rates in RATE_STEP steps,
    at most 640 phases to 16 kHz). Blocks keep the working memory small."""
    if rate_in == rate_out or x.size == 0:
        return x.astype(np.float32, copy=False)
    for r in (rate_in, rate_out):   # the filter's width grows with rate_in / rate_out
        if not MIN_RATE <= r <= MAX_RATE:
            raise ValueError(f"sample rate {r} Hz is outside {MIN_RATE}..{MAX_RATE} Hz")
    g = math.gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g
    cutoff = min(1.0, up / down) * 0.97
    width = int(np.ceil(half_taps / cutoff))
    offs = np.arange(-width + 1, width + 1)
    n_out = int(round(x.size * rate_out / rate_in))
    # Zeros beyond both ends: output n reads inputs floor(n*M/L) - width + 1 .. + width.
    xp = np.zeros(x.size + 2 * width + down + 2, np.float32)
    xp[width:width + x.size] = x
    windows = np.lib.stride_tricks.sliding_window_view(xp, offs.size)
    out = np.empty(n_out, np.float32)
    phases = min(up, n_out)
    per_chunk = max(1, BLOCK_ELEMS // offs.size)
    for p0 in range(0, phases, per_chunk):
        p = np.arange(p0, min(phases, p0 + per_chunk))
        base = p * down // up
        w = _phase_weights(up, down, half_taps, p0, p0 + p.size)
        # Output p + j*L starts its window j*M inputs after output p's (shifted by the padding).
        q = (n_out - 1 - p0) // up + 1
        step = max(1, BLOCK_ELEMS // w.size)
        for j0 in range(0, q, step):
            j = np.arange(j0, min(q, j0 + step))[:, None]
            n = p + j * up
            y = np.einsum("jpk,pk->jp", windows[base + 1 + j * down], w)
            keep = n < n_out
            out[n[keep]] = y[keep]
    return out


@functools.lru_cache(maxsize=4)     # parts of one request mostly share a rate; at most 4 x BLOCK_ELEMS floats
def _phase_weights(up: int, down: int, half_taps: int, p0: int, p1: int) -> np.ndarray:
    """Phases p0..p1-1's weights, one row each (float32, read-only)."""
    cutoff = min(1.0, up / down) * 0.97
    width = int(np.ceil(half_taps / cutoff))
    frac = np.arange(p0, p1) * down % up
    d = (frac / up)[:, None] - np.arange(-width + 1, width + 1)    # each tap's distance from the output instant
    w = (cutoff * np.sinc(cutoff * d) * (0.5 + 0.5 * np.cos(np.pi * np.clip(d / width, -1.0, 1.0))))
    w = w.astype(np.float32)
    w.flags.writeable = False
    return w
