"""Bundled real models and name resolution (see resolve.py)."""

from omni.models.resolve import BUNDLED, BundledModel, resolve_model

__all__ = ["BUNDLED", "BundledModel", "resolve_model"]
