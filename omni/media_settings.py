"""The deploy config's `pipeline.images` and `pipeline.videos`: the defaults and bounds of the image and
video routes (omni/api/images.py, omni/api/videos.py), validated once with the rest of the config
(omni/config.py)."""

from __future__ import annotations

import msgspec

from omni.digits import ascii_int
from omni.errors import ConfigError

__all__ = ["ImageSettings", "PromptExpansion", "VideoSettings", "validate_images"]


class PromptExpansion(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An AR -> DiT pipeline: the chat the frontend renders with the writer LM's chat template (stage 0)
    to have it expand the client's image prompt; the DiT renders what the LM writes."""
    system: str
    user: str = "{prompt}"              # `{prompt}`: the client's prompt


class ImageSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """/v1/images/generations of a pipeline with an image stage: defaults and the bounds it enforces."""
    size_multiple: int = 16             # width and height: whole latent patches (VAE scale x DiT patch size)
    default_size: str = "1024x1024"
    max_pixels: int = 1024 * 1024
    default_steps: int = 50
    max_steps: int = 100
    default_guidance_scale: float = 4.0   # Qwen-Image's true CFG scale
    default_negative_prompt: str = " "    # Qwen-Image's: guidance on by default
    max_n: int = 4
    max_prompt_chars: int = 4000
    # Set: stage 0 is an LM that writes the image stage's prompt from the client's (an AR -> DiT pipeline).
    expand: PromptExpansion | None = None


class VideoSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """/v1/videos of a pipeline with a video stage: defaults and bounds (the image fields mean what they do
    there; max_pixels is a frame's). Frames: 1 more than a multiple of `frame_multiple` (the VAE's)."""
    size_multiple: int = 16
    default_size: str = "832x480"
    max_pixels: int = 1280 * 720
    # A frame's width or height: the DiT's rotary position table bounds each side (Wan: rope_max_seq_len
    # 1024 positions x size_multiple 16 px); past it the stage's forward fails, so the frontend refuses it.
    max_side: int = 16384
    default_steps: int = 50
    max_steps: int = 100
    default_guidance_scale: float = 5.0
    default_negative_prompt: str = ""
    max_prompt_chars: int = 4000
    frame_multiple: int = 4
    default_frames: int = 81
    max_frames: int = 81
    default_fps: int = 16
    max_fps: int = 60


def validate_images(s: ImageSettings | VideoSettings, where: str) -> None:
    for key in ("size_multiple", "max_pixels", "max_side", "default_steps", "max_steps", "max_n", "max_prompt_chars",
                "frame_multiple", "max_frames", "max_fps", "default_fps"):
        if getattr(s, key, 1) < 1:
            raise ConfigError(f"{where}.{key} must be >= 1, got {getattr(s, key)}")
    w, sep, h = s.default_size.partition("x")
    w, h = ascii_int(w), ascii_int(h)
    if not sep or w is None or h is None or w % s.size_multiple or h % s.size_multiple \
            or w * h > s.max_pixels or max(w, h) > getattr(s, "max_side", max(w, h)):
        raise ConfigError(f"{where}.default_size {s.default_size!r} must be WxH, multiples of size_multiple "
                          f"{s.size_multiple}, at most max_pixels {s.max_pixels} (and max_side a side)")
    if s.default_steps > s.max_steps:
        raise ConfigError(f"{where}.default_steps {s.default_steps} is over max_steps {s.max_steps}")
    if isinstance(s, VideoSettings) and ((s.default_frames - 1) % s.frame_multiple or s.default_frames > s.max_frames
                                         or s.default_fps > s.max_fps):
        raise ConfigError(f"{where}.default_frames {s.default_frames} must be 1 more than a multiple of frame_multiple "
                          f"{s.frame_multiple}, at most max_frames {s.max_frames}; default_fps at most max_fps")
