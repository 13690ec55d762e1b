"""The tensor transport contract.

A producer stage process owns a TensorProducer; `put()` places a tensor where
consumers can reach it and returns a TensorRef, a small descriptor that rides
in stage-channel messages (through the orchestrator). A consumer stage owns a
TensorConsumer; `get()` turns a TensorRef back into a tensor, zero-copy where
the transport allows. The producer frees a tensor when told (`free`), or frees
everything owned by a consumer/request that is gone (`free_owner`).
"""

from __future__ import annotations

import abc

import msgspec
import torch


class TensorRef(msgspec.Struct, frozen=True, kw_only=True):
    transport: str              # "shm" | "tcp" | "gloo" | "nccl" | "cuda_ipc"
    endpoint: str               # where the producer can be reached (segment name, host:port, ...)
    key: int                    # producer-unique id of this tensor
    dtype: str                  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0             # byte offset inside the segment (shm, cuda_ipc)
    owner: str = ""             # the request (or consumer) this tensor belongs to
    # The producing object (process + producer): keys are unique only within it, so a free names it
    # and a replica restarted under the same id ignores its predecessor's frees.
    incarnation: str = ""


# Refs of these transports can be read on the producer's host only.
SAME_HOST_ONLY = frozenset({"shm", "cuda_ipc"})


class TransportError(Exception):
    """A request-level transport failure (freed/foreign ref, bad dtype/shape, too large)."""


class TensorRefused(TransportError):
    """This tensor only (its size, its device): the producer takes others, and another transport
    may carry this one."""


class ProducerFull(TransportError):
    """The producer holds its limit of unacknowledged bytes. Not a failure: the caller
    waits until consumers free tensors (backpressure) and puts again."""


class TensorProducer(abc.ABC):
    @abc.abstractmethod
    def put(self, tensor: torch.Tensor, owner: str = "") -> TensorRef: ...

    @abc.abstractmethod
    def free(self, keys: list[int]) -> None: ...

    @abc.abstractmethod
    def free_owner(self, owner: str) -> None: ...

    # The setting that bounds what it holds unacked (named when an output can never fit).
    limit_name = ""
    incarnation = ""    # what its refs carry as TensorRef.incarnation

    def refuses(self, tensor: torch.Tensor) -> str:
        """Why put() would refuse this tensor by itself (TensorRefused), "" when it takes it."""
        return ""

    def bytes_in_use(self) -> int:
        return 0

    def capacity_bytes(self) -> int:
        """The most bytes it holds unacked; 0: no bound."""
        return 0

    @abc.abstractmethod
    def close(self) -> None: ...


class TensorConsumer(abc.ABC):
    @abc.abstractmethod
    def get(self, ref: TensorRef) -> torch.Tensor: ...

    def close(self) -> None:
        pass
