"""Reading a final output's tensor for the client (the executor's side of `Emit`).

A shared-memory ref (shm, cuda_ipc: the producing stage is on this host) is a memcpy: it is
read on the event loop, where it costs less than a hop to a thread and back. A ref of another
host (tcp, gloo, nccl) is a network read that may wait up to the transport's timeout (30 s):
it runs on a small thread pool, so the frontend's other requests go on meanwhile. Its output
takes its place in the request's queue at once as a future, so the request's outputs reach
the client in the order the core emitted them, whichever read ends first; a read's error is
that future's (the request's error). A producer is told to free a tensor (`Free`) only after
every read of it ended, also when the request was cancelled meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable

import numpy as np

from omni.orchestrator.types import PipelineOutput
from omni.transport.base import SAME_HOST_ONLY, TensorRef

FETCH_THREADS = 4       # remote reads at once per frontend; more wait for a thread


def fill(consumer: Any, out: PipelineOutput, ref: TensorRef) -> PipelineOutput:
    """Read `ref` into `out`: an image's bytes and shape, an audio chunk's float32 PCM, an embedding."""
    tensor = consumer.get(ref)
    if out.modality in ("image", "video"):
        out.image, out.image_shape = tensor.numpy().tobytes(), tuple(tensor.shape)
    elif out.modality == "audio":
        out.audio_pcm = tensor.float().numpy().astype(np.float32).tobytes()
    else:
        out.embedding = tensor.float().flatten().tolist()
    return out


def is_local(ref: TensorRef) -> bool:
    return ref.transport in SAME_HOST_ONLY


class Fetcher:
    """Remote reads off the event loop, and the frees that wait for them (all on the loop's thread,
    except the reads themselves)."""

    def __init__(self, threads: int = FETCH_THREADS):
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._reading: dict[tuple[str, int], int] = {}             # (transport, key) -> reads running
        self._deferred: dict[tuple[str, int], list[str]] = {}      # frees waiting for them: replica ids

    def read(self, consumer: Any, out: PipelineOutput, ref: TensorRef,
             done: Callable[[PipelineOutput | BaseException], None]) -> None:
        """Start reading `ref` into `out` on the pool; `done` gets `out` or the error, on the loop."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="omni-fetch")
        k = (ref.transport, ref.key)
        self._reading[k] = self._reading.get(k, 0) + 1
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fill, consumer, out, ref)

        def finished(f: asyncio.Future) -> None:
            n = self._reading.pop(k) - 1
            if n:
                self._reading[k] = n
            if f.cancelled():
                done(asyncio.CancelledError())
            else:
                done(f.exception() or f.result())
        fut.add_done_callback(finished)

    def hold(self, replica_id: str, transport: str, keys: tuple[int, ...]) -> tuple[int, ...]:
        """The keys of a Free that no read is using (to free now); the others are kept until
        their reads end (`released`)."""
        now = []
        for key in keys:
            if (transport, key) in self._reading:
                self._deferred.setdefault((transport, key), []).append(replica_id)
            else:
                now.append(key)
        return tuple(now)

    def released(self, ref: TensorRef) -> list[tuple[str, str, tuple[int, ...]]]:
        """The frees of `ref` that waited for its reads, once none is running: (replica, transport, keys)."""
        k = (ref.transport, ref.key)
        if k in self._reading:
            return []
        return [(replica_id, ref.transport, (ref.key,)) for replica_id in self._deferred.pop(k, ())]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
