"""What shm and cuda_ipc producers share: an arena of segments, made as it fills, with keyed
first-fit slots (alloc.KeyedSlots) that are freed on ack, and a unix-socket server that hands a
segment to a consumer once. Subclasses make a segment's memory and clear a freed slot's check."""

from __future__ import annotations

import abc
import threading
from typing import Any

from omni.transport.alloc import KeyedSlots
from omni.transport.base import ProducerFull, TensorProducer, TransportError


class ArenaProducer(TensorProducer):
    transport = ""
    limit_name = "arena_bytes"

    def __init__(self, arena_bytes: int, max_segments: int, align: int, name: str):
        self.arena_bytes = arena_bytes
        self.max_segments = max_segments
        self.name = name
        self.incarnation = name    # pid and a random tag: unique to this producer
        self._lock = threading.Lock()
        self._book = KeyedSlots(arena_bytes, max_segments, align)
        self._segments: list[Any] = []
        self._closed = False
        self._server: Any = None

    @abc.abstractmethod
    def _new_segment(self, index: int) -> Any: ...

    @abc.abstractmethod
    def _cleared(self, key: int, segment: Any, offset: int) -> None:
        """A slot was freed (under the lock, also after close): a ref to it must fail from now on."""

    @abc.abstractmethod
    def _close_segment(self, segment: Any) -> None: ...

    def _reserve(self, need: int, owner: str) -> tuple[Any, int, int]:
        """(segment, offset, key) of a slot of `need` bytes; ProducerFull when the arena is."""
        with self._lock:
            if self._closed:
                raise TransportError(f"{self.transport} producer {self.name} is closed")
            got = self._book.reserve(need, owner)
            if got is None:
                raise ProducerFull(
                    f"{self.transport} arena full: {self._book.bytes_in_use()} of "
                    f"{self.arena_bytes * self.max_segments} bytes in use, {need} more needed; "
                    "consumers must ack (free) tensors")
            index, off, key = got
            if index == len(self._segments):
                try:
                    self._segments.append(self._new_segment(index))
                except BaseException:
                    self._book.drop_segment(key)
                    raise
        return self._segments[index], off, key

    def free(self, keys: list[int]) -> None:
        with self._lock:
            for key, index, off in self._book.release(keys):
                self._cleared(key, self._segments[index], off)

    def free_owner(self, owner: str) -> None:
        with self._lock:
            keys = self._book.keys_of(owner)
        self.free(keys)

    def bytes_in_use(self) -> int:
        with self._lock:
            return self._book.bytes_in_use()

    def capacity_bytes(self) -> int:
        return self.arena_bytes * self.max_segments

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._server is not None:
            self._server.close()
        with self._lock:
            for seg in self._segments:
                self._close_segment(seg)
            self._segments.clear()
            self._book.clear()
