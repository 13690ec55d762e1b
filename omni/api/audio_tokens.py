"""What an audio part costs in the thinker's prompt: vLLM's Qwen-Omni processors expand its one
placeholder to the audio tower's output length, so the prompt a talker prefills is longer than the
frontend's token ids by that much; and the shortest audio each tower takes (a shorter one fails in
vLLM's processor with an error that dumps the waveform). Both as vLLM 0.32 computes them on the
16 kHz waveform the frontend sends (tests/unit/test_audio_tokens.py checks them against it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

HOP = 160   # WhisperFeatureExtractor's hop at 16 kHz: one mel frame per 10 ms


CHUNK = 480000     # the feature extractor's 30 s: shorter audio is padded to it


def qwen3_positions(n: int) -> int:
    """Qwen3-Omni: each 100-frame window gives 13 positions, the rest three stride-2 convolutions."""
    f = -(-n // HOP)     # vLLM pads the waveform to a whole hop first
    rest = (f % 100 - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + f // 100 * 13


def qwen25_positions(n: int) -> int:
    """Qwen2.5-Omni: a stride-2 convolution, then a stride-2 pooling. The frames are the feature extractor's
    attention mask's: one a started hop, less the last one past 30 s off a hop's end."""
    f = -(-n // HOP) if n <= CHUNK or n % HOP == 0 else n // HOP
    conv = (f - 1) // 2 + 1
    return (conv - 2) // 2 + 1


@dataclass(frozen=True)
class AudioTower:
    name: str
    # Qwen3: the feature extractor reflect-pads 200 samples a side, which needs 201 after the hop padding;
    # Qwen2.5: fewer than 3 frames pool to no position at all.
    min_samples: int
    positions: Callable[[int], int]


TOWERS = {"qwen3_omni_moe": AudioTower("Qwen3-Omni", 161, qwen3_positions),
          "qwen2_5_omni": AudioTower("Qwen2.5-Omni", 321, qwen25_positions)}


def tower_of(model_dir: str | None) -> AudioTower | None:
    """The audio tower of the model in `model_dir` (its config.json's model_type); None: not one we know."""
    from omni.models.resolve import model_config

    return TOWERS.get((model_config(model_dir) or {}).get("model_type")) if model_dir else None
