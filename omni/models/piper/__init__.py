"""The Piper pipeline (the default on CPU): a SmolLM2 thinker, then Piper VITS split into a talker
(text -> latent frames) and a vocoder (latents -> 22.05 kHz); see omni/models/registry.py."""
