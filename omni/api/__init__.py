"""The OpenAI-compatible HTTP frontend (Starlette app + Hypercorn runner)."""

from omni.api.app import build_app
from omni.api.voices import InMemoryVoiceStore, VoiceStoreLike

__all__ = ["build_app", "InMemoryVoiceStore", "VoiceStoreLike"]
