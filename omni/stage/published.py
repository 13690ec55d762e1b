"""Tensors a stage sent to frontends that no FreeTensors has freed yet, by request.

A request leaves the worker's in-flight table with its finishing output, but the frontend
frees its tensors later; should that frontend go, or abort the request, or its output be
dropped unsent, the worker frees them by owner (the request id) from this record."""

from __future__ import annotations

from typing import Iterable

from omni.transport.base import TensorRef


class Published:
    def __init__(self) -> None:
        self._rid_of: dict[tuple[str, int], str] = {}       # (transport, key) -> request id
        self._keys: dict[str, set[tuple[str, int]]] = {}    # request id -> its refs not freed
        self._frontend: dict[str, bytes] = {}                # request id -> the frontend sent them

    def add(self, frontend: bytes, rid: str, refs: Iterable[TensorRef]) -> None:
        for r in refs:
            self._rid_of[(r.transport, r.key)] = rid
            self._keys.setdefault(rid, set()).add((r.transport, r.key))
            self._frontend[rid] = frontend

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

    def forget(self, rid: str) -> None:
        """Its producers freed everything the request owns."""
        for k in self._keys.pop(rid, ()):
            self._rid_of.pop(k, None)
        self._frontend.pop(rid, None)

    def __len__(self) -> int:
        return len(self._rid_of)
