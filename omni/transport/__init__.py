"""Tensor transports: descriptors in messages, bytes apart (see base.py)."""
