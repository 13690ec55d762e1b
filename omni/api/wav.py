"""float32 PCM -> 16-bit PCM and WAV bytes (a small private helper for the HTTP routes)."""

from __future__ import annotations

import struct

import numpy as np


def pcm16(pcm_f32: bytes) -> bytes:
    """Little-endian float32 mono samples -> little-endian int16, clipped to [-1, 1]."""
    x = np.frombuffer(pcm_f32, dtype="<f4")
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_bytes(pcm_f32: bytes, sample_rate: int) -> bytes:
    data = pcm16(pcm_f32)
    header = struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 36 + len(data), b"WAVE", b"fmt ", 16,
                         1, 1, sample_rate, sample_rate * 2, 2, 16, b"data", len(data))
    return header + data
