"""Waveform encoding: float32 samples in [-1, 1] -> 16-bit PCM / WAV bytes."""

from __future__ import annotations

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
