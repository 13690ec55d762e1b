"""Garbage-collector set-up for long-running serving processes."""

from __future__ import annotations

import gc


def freeze_after_startup() -> None:
    """Move everything start-up made (torch, vLLM, transformers: millions of objects) out of
    the collector's view, as vLLM's own server does: a full collection over that heap
    stalls the process for hundreds of ms (measured 0.2-2.5 s on a loaded 2-core box,
    omni/latency_trace.py), and it would run in the middle of a token stream. Objects made
    later are collected as usual."""
    gc.collect()
    gc.freeze()
