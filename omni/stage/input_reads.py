"""A stage's input tensors of another host, read off its loop thread.

A ref of another host (tcp, gloo, nccl) is a network read that waits up to the transport's timeouts
when its producer stops answering (5 s at a connect or hello, 30 s on an open connection): read on the
loop, that held the whole replica (its other requests, frees, utility calls, steps). Such an
AddRequest is read on a small pool of daemon threads and admitted to the engine when its read ends;
its error (TransportError) is that request's, as it was inline. A same-host ref (shm, cuda_ipc) is a
mapping that waits on nothing: read inline, as is a request with no refs.

Order: the AddRequests of one request (its base id, "r1" of "r1/s2") reach the engine in the order they
came: a stream's later piece waits behind an earlier one still being read, also one that needs no
read. An Abort drops its request's waiting pieces, a frontend gone its own: a read running then
ends on its thread and its tensors are dropped, never admitted. Nothing is freed at the producer here:
the frontend frees a request's inputs there, as for one the stage took.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from typing import Any, Callable

import torch

from omni.daemon_pool import DaemonPool
from omni.stage import messages as m
from omni.transport.base import SAME_HOST_ONLY

READ_THREADS = 4    # remote input reads at once per stage replica; more wait for a thread


def base_of(rid: str) -> str:
    return rid.split("/", 1)[0]


def remote(msg: m.AddRequest) -> bool:
    return any(ref.transport not in SAME_HOST_ONLY for ref in msg.tensors.values())


def read_remote(consumer: Any, msg: m.AddRequest) -> dict[str, torch.Tensor]:
    """`msg`'s tensors of other hosts (a pool thread); its same-host ones are read on admission."""
    return {name: consumer.get(ref) for name, ref in msg.tensors.items() if ref.transport not in SAME_HOST_ONLY}


def _outcome(f: concurrent.futures.Future | None) -> dict[str, torch.Tensor] | BaseException | None:
    if f is None:
        return None
    return f.exception() or f.result()


class _Waiting:
    __slots__ = ("ident", "msg", "future")

    def __init__(self, ident: bytes, msg: m.AddRequest, future: concurrent.futures.Future | None):
        self.ident, self.msg, self.future = ident, msg, future


class InputReads:
    """The AddRequests that wait for a read (theirs, or an earlier piece's of their request). Loop thread
    only, except the reads and the `wake` their end calls."""

    def __init__(self, consumer: Any, wake: Callable[[], None], threads: int = READ_THREADS):
        self._consumer = consumer
        self._wake = wake
        self._threads = threads
        self._pool: DaemonPool | None = None
        self._queues: dict[str, deque[_Waiting]] = {}   # base id -> its pieces, in the order they came
        self._due = False   # a read ended or a queue's head went: `ready` looks again

    def __bool__(self) -> bool:
        return bool(self._queues)

    def waits(self, rid: str) -> bool:
        """Whether a piece of `rid`'s request waits here (a later one is no new request)."""
        return base_of(rid) in self._queues

    def take(self, ident: bytes, msg: m.AddRequest) -> bool:
        """Queue `msg` when it must wait: its read, or an earlier piece of its request's. False: admit it now."""
        base = base_of(msg.request_id)
        read = self._consumer is not None and remote(msg)   # no consumer: refused on admission as before
        if not read and base not in self._queues:
            return False
        future = None
        if read:
            if self._pool is None:
                self._pool = DaemonPool(self._threads, "omni-input")
            future = self._pool.submit(read_remote, self._consumer, msg)
            future.add_done_callback(self._ended)
        self._queues.setdefault(base, deque()).append(_Waiting(ident, msg, future))
        return True

    def _ended(self, _f: concurrent.futures.Future) -> None:
        self._due = True    # any thread; set before the wake, so the woken loop sees it
        self._wake()

    def ready(self) -> list[tuple[bytes, m.AddRequest, dict[str, torch.Tensor] | BaseException | None]]:
        """The pieces now due, each request's in order: (frontend, message, its remote tensors or the
        read's error; None when it read nothing)."""
        if not self._due:
            return []
        self._due = False
        out = []
        for base in list(self._queues):
            q = self._queues[base]
            while q and (q[0].future is None or q[0].future.done()):
                w = q.popleft()
                out.append((w.ident, w.msg, _outcome(w.future)))
            if not q:
                del self._queues[base]
        return out

    def _drop(self, gone: Callable[[_Waiting], bool]) -> None:
        for base in list(self._queues):
            left = deque()
            for w in self._queues[base]:
                if not gone(w):
                    left.append(w)
                elif w.future is not None:
                    w.future.cancel()   # not started yet: never read; a running read ends on its own
            if left:
                self._queues[base] = left
            else:
                del self._queues[base]
        self._due = True    # a new head may need no read

    def abort(self, rid: str) -> None:
        if base_of(rid) in self._queues:
            self._drop(lambda w: w.msg.request_id == rid)

    def frontend_gone(self, ident: bytes) -> None:
        if self._queues:
            self._drop(lambda w: w.ident == ident)

    def new_requests(self, known: Any) -> int:
        """Waiting requests not in `known` (not yet taken: counted in flight)."""
        return sum(1 for rid in {w.msg.request_id for q in self._queues.values() for w in q} if rid not in known)

    def drop_all(self) -> list[tuple[bytes, str]]:
        """Drop every waiting piece; the (frontend, request id) of each request, once."""
        left = {w.msg.request_id: w.ident for q in self._queues.values() for w in q}
        self._drop(lambda w: True)
        return [(ident, rid) for rid, ident in left.items()]

    def close(self) -> list[tuple[bytes, str]]:
        """Stop reading; the (frontend, request id) of each request left waiting, once."""
        left = {w.msg.request_id: w.ident for q in self._queues.values() for w in q}
        self._queues.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return [(ident, rid) for rid, ident in left.items()]
