"""Reading a final output's tensor for the client (the executor's side of `Emit`).

A small shared-memory ref (shm, cuda_ipc: the producing stage is on this host; an audio chunk) is a
memcpy: it is read on the event loop, where it costs less than a hop to a thread and back. A larger
one (a finished image or video: 1280x720x81 frames is 224 MB, 344 ms to copy) and a ref of another
host (tcp, gloo, nccl: a network read that may wait up to the transport's timeout, 30 s) are read
on a small pool of daemon threads, so the frontend's other requests go on meanwhile
(and a read stuck at shutdown does not hold up the process's exit): an image's copy is torch's, which
lets go of the GIL (`host_bytes`), and the consumer keeps a segment mapped while a view of it lives
(omni/transport/shm.py), so a sweep on another thread cannot unmap it under the copy. Its output takes its place
in the request's queue at once as a future, so the request's outputs reach the client in the
order the core emitted them, whichever read ends first; a read's error is that future's (the
request's error), unless the request already failed: its own error is queued, and the
placeholder is dropped.

The orchestrator's `Free` of a tensor being read waits for the read, also when the request was
cancelled meanwhile. A tensor is known by its producer (the replica id the core saw it from),
transport, key and incarnation: keys are only unique per producing process. A waiting Free goes to the
channel it was meant for, and is dropped if that channel closed meanwhile (the replica went,
or restarted under the same id: its keys start at 1 again and name other tensors). This holds
for frees the frontend sends only: a stage frees on its own whatever a request owns when it
takes the request's Abort or fails it (omni/stage/intake.py), so a read racing that ends in
an unknown-key error; the request's own failure is what its client gets then.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import numpy as np
import torch

from omni.daemon_pool import DaemonPool
from omni.errors import Unavailable
from omni.orchestrator.types import PipelineOutput
from omni.transport.base import SAME_HOST_ONLY, TensorRef

FETCH_THREADS = 4       # reads off the loop at once per frontend; more wait for a thread
LOOP_READ_BYTES = 1 << 20   # a same-host ref up to this is copied on the loop; a larger one stalls it


def fill(consumer: Any, out: PipelineOutput, ref: TensorRef) -> PipelineOutput:
    """Read `ref` into `out`: an image's bytes and shape, an audio chunk's float32 PCM, an embedding."""
    tensor = consumer.get(ref)
    if out.modality in ("image", "video"):
        out.image, out.image_shape = host_bytes(tensor), tuple(tensor.shape)
    elif out.modality == "audio":
        out.audio_pcm = tensor.float().numpy().astype(np.float32).tobytes()
    else:
        out.embedding = tensor.float().flatten().tolist()
    return out


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """`tensor`'s bytes in host memory of their own, copied by torch, which releases the GIL meanwhile
    (numpy's tobytes, and bytearray's zero fill, hold it throughout: the frontend's event loop stood
    still for the whole copy even on a fetch thread, 275 ms for 384 MiB)."""
    src = tensor.reshape(-1).view(torch.uint8)
    out = torch.empty(src.numel(), dtype=torch.uint8)
    out.copy_(src)
    return memoryview(out.numpy())   # keeps `out`; np.frombuffer reads it as it read the bytes


def on_loop(ref: TensorRef) -> bool:
    """Whether `ref` is read on the event loop: a same-host memcpy small enough not to stall it."""
    return ref.transport in SAME_HOST_ONLY and ref.nbytes <= LOOP_READ_BYTES


class Fetcher:
    """Reads off the event loop (remote or large), and the frees that wait for them (all on the loop's thread,
    except the reads themselves)."""

    def __init__(self, threads: int = FETCH_THREADS):
        self._threads = threads
        self._pool: DaemonPool | None = None
        self._closed = False
        # (producer replica, transport, key, incarnation) -> reads running; frees waiting for them: where to send each
        self._reading: dict[tuple[str, str, int, str], int] = {}
        self._deferred: dict[tuple[str, str, int, str], list[Any]] = {}

    def read(self, consumer: Any, out: PipelineOutput, ref: TensorRef, producer: str,
             done: Callable[[PipelineOutput | BaseException], None]) -> None:
        """Start reading `ref` (published by replica `producer`) into `out` on the pool; `done` gets
        `out` or the error, on the loop. Refused (Unavailable) once closed."""
        if self._closed:
            raise Unavailable("frontend is shutting down: no more tensor reads")
        if self._pool is None:
            self._pool = DaemonPool(self._threads, "omni-fetch")
        k = (producer, ref.transport, ref.key, ref.incarnation)
        fut = asyncio.wrap_future(self._pool.submit(fill, consumer, out, ref))
        self._reading[k] = self._reading.get(k, 0) + 1

        def finished(f: asyncio.Future) -> None:
            n = self._reading.pop(k) - 1
            if n:
                self._reading[k] = n
            if f.cancelled():
                done(asyncio.CancelledError())
            else:
                done(f.exception() or f.result())
        fut.add_done_callback(finished)

    def reading_from(self, producer: str) -> bool:
        return any(k[0] == producer for k in self._reading)

    def hold(self, producer: str, transport: str, keys: tuple[int, ...], target: Any,
             incarnation: str = "") -> tuple[int, ...]:
        """The keys of a Free that no read is using (to free now); the others are kept, with the
        `target` (channel) to free them at, until their reads end (`released`)."""
        now = []
        for key in keys:
            if (producer, transport, key, incarnation) in self._reading:
                self._deferred.setdefault((producer, transport, key, incarnation), []).append(target)
            else:
                now.append(key)
        return tuple(now)

    def released(self, producer: str, ref: TensorRef) -> list[Any]:
        """Where the frees of `ref` that waited for its reads go, once none is running."""
        k = (producer, ref.transport, ref.key, ref.incarnation)
        if k in self._reading:
            return []
        return self._deferred.pop(k, [])

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
