"""Reusable receive buffers for the tcp consumer.

A 64 MiB tensor from `torch.empty` is a fresh mmap (glibc maps anything over 32 MiB), so the
kernel faults in every page while copying from the socket: that halved tcp bandwidth at 64 MiB
(docs/transport-benchmarks.md). The pool keeps buffers whose pages are already present.

Ownership: none changes for the caller. A tensor handed out holds (through its storage) a
numpy view of its buffer; the pool reuses a buffer only when nothing refers to it anymore, so a
consumer may keep, view or modify the tensor as long as it likes. Pure Python, no I/O.
"""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np
import torch

MIN_POOLED = 1 << 20              # smaller tensors come from the malloc heap, already reused
DEFAULT_POOL_BYTES = 256 << 20    # buffers kept, in use or idle
_PAGE = mmap.PAGESIZE


def _new_buffer(nbytes: int) -> np.ndarray:
    # MAP_POPULATE faults the pages in at once, cheaper than one fault per page during recv.
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    return np.frombuffer(m, dtype=np.uint8)


def _refs_when_idle() -> int:
    # What getrefcount reports, in _idle's own expression, for a buffer only a list holds (3 on
    # CPython 3.11: the list, `b`, the argument); measured, since interpreters may borrow references.
    bufs = [np.empty(1, dtype=np.uint8)]
    return [sys.getrefcount(b) for b in bufs][0]


_IDLE_REFS = _refs_when_idle()


class RecvPool:
    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._bufs: list[np.ndarray] = []
        self.bytes = 0                # capacity of the buffers held
        self.reused = 0               # tensors served from an existing buffer (tests, stats)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """An uninitialised tensor, on a pooled buffer when the size is worth it and the pool
        has room, else from `torch.empty`."""
        if nbytes < MIN_POOLED or nbytes > self.max_bytes:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            idle = self._idle()
            fits = [b for b in idle if nbytes <= b.nbytes <= 2 * nbytes]   # bounded waste
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self.reused += 1
            else:
                buf = self._grow(-(-nbytes // _PAGE) * _PAGE, idle)
                if buf is None:
                    return torch.empty(shape, dtype=dtype)
            del idle, fits
            # the storage holds `buf` for as long as this tensor or any view of it lives
            return torch.from_numpy(buf)[:nbytes].view(dtype).reshape(shape)

    def _idle(self) -> list[np.ndarray]:
        return [b for b in self._bufs if sys.getrefcount(b) <= _IDLE_REFS]

    def _grow(self, size: int, idle: list[np.ndarray]) -> np.ndarray | None:
        for buf in sorted(idle, key=lambda b: -b.nbytes):   # drop idle buffers, largest first
            if self.bytes + size <= self.max_bytes:
                break
            self._bufs = [b for b in self._bufs if b is not buf]   # not list.remove: arrays compare by value
            self.bytes -= buf.nbytes
        if self.bytes + size > self.max_bytes:
            return None
        buf = _new_buffer(size)
        self._bufs.append(buf)
        self.bytes += size
        return buf

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()
            self.bytes = 0
