"""Tensors a stage sent to frontends that no FreeTensors has freed yet, by request.

A request leaves the worker's in-flight table with its finishing output, but the frontend
frees its tensors later; should that frontend go, or abort the request, or its output be
dropped unsent, the worker frees them by owner (the request id) from this record.

A frontend on ZMQ (another host, or after a fallback from the local channel) that dies is not
seen (nothing is sent to it once its requests are done), so the tensors of a request done here
are also freed `ttl_s` after its last publish (`stale`): the stage is given the pipeline's
request_timeout_s, the frontend's own bound on every request (measured from before its first
output here), past which that frontend has ended the request, freed or failed, itself."""

from __future__ import annotations

import time
from typing import Container, Iterable

from omni.transport.base import TensorRef
from omni.transport.sweep import Sweep

SWEEP_S = 1.0   # how often `stale` looks


class Published:
    def __init__(self, ttl_s: float = 300.0) -> None:
        self.ttl_s = ttl_s
        self._rid_of: dict[tuple[str, int], str] = {}       # (transport, key) -> request id
        self._keys: dict[str, set[tuple[str, int]]] = {}    # request id -> its refs not freed
        self._frontend: dict[str, bytes] = {}                # request id -> the frontend sent them
        self._at: dict[str, float] = {}                      # request id -> its last publish, oldest first
        self._sweep = Sweep(SWEEP_S)

    def add(self, frontend: bytes, rid: str, refs: Iterable[TensorRef]) -> None:
        for r in refs:
            self._rid_of[(r.transport, r.key)] = rid
            self._keys.setdefault(rid, set()).add((r.transport, r.key))
            self._frontend[rid] = frontend
        if rid in self._keys:
            self._at.pop(rid, None)
            self._at[rid] = time.monotonic()

    def freed(self, transport: str, keys: Iterable[int]) -> None:
        for key in keys:
            rid = self._rid_of.pop((transport, key), None)
            held = self._keys.get(rid) if rid is not None else None
            if held is not None:
                held.discard((transport, key))
                if not held:
                    self.forget(rid)

    def of_frontend(self, frontend: bytes) -> list[str]:
        return [rid for rid, f in self._frontend.items() if f == frontend]

    def stale(self, live: Container[str]) -> list[str]:
        """Requests not in `live` (done here) with tensors unfreed `ttl_s` after their last publish;
        looks once a SWEEP_S (else [])."""
        if not self._sweep.due():
            return []
        cutoff = time.monotonic() - self.ttl_s
        out = []
        for rid, at in self._at.items():
            if at > cutoff:
                break
            if rid not in live:
                out.append(rid)
        return out

    def forget(self, rid: str) -> None:
        """Its producers freed everything the request owns."""
        for k in self._keys.pop(rid, ()):
            self._rid_of.pop(k, None)
        self._frontend.pop(rid, None)
        self._at.pop(rid, None)

    def __len__(self) -> int:
        return len(self._rid_of)
