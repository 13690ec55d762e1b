"""The HTTP routes' view of omni.audio: PipelineOutput carries float32 PCM as bytes."""

from __future__ import annotations

import numpy as np

from omni import audio


def _samples(pcm_f32: bytes) -> np.ndarray:
    return np.frombuffer(pcm_f32, dtype="<f4")


def pcm16(pcm_f32: bytes) -> bytes:
    """Little-endian float32 mono samples -> little-endian int16, clipped to [-1, 1]."""
    return audio.pcm16_bytes(_samples(pcm_f32))


def wav_bytes(pcm_f32: bytes, sample_rate: int) -> bytes:
    return audio.wav_bytes(_samples(pcm_f32), sample_rate)


def streaming_wav_header(sample_rate: int) -> bytes:
    """A mono s16le WAV header for a stream whose length is not known yet: the RIFF and data sizes
    at their most (0xFFFFFFFF), as streamed WAV is written; players read to the end of the body."""
    header = bytearray(audio.wav_bytes(np.zeros(0, dtype=np.float32), sample_rate)[:44])
    header[4:8] = header[40:44] = b"\xff\xff\xff\xff"
    return bytes(header)
