"""Progress marks from inside a long forward: a hook on each block of a model's block lists (transformer
layers, a VAE's up blocks), so a step of several minutes on CPU says it moves every few seconds
(pipeline.loop_stall_s, omni/stage/loop_watch.py) and one stuck in a block says nothing."""

from __future__ import annotations

from typing import Any, Callable


def mark_blocks(root: Any, mark: Callable[[], None]) -> int:
    """Call `mark()` after each forward of a block of `root` (an nn.Module, else nothing): an entry of an
    nn.ModuleList that has modules of its own; leaf layers (an attention's output Linear) are left alone, a
    Python call per block being nothing beside its compute. Returns how many blocks were hooked."""
    import torch

    if not isinstance(root, torch.nn.Module):
        return 0
    blocks = [b for ml in root.modules() if isinstance(ml, torch.nn.ModuleList)
              for b in ml if next(b.children(), None) is not None]
    for b in blocks:
        b.register_forward_hook(lambda *_: mark())
    return len(blocks)
