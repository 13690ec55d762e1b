"""Pick, build and dispatch transports by name."""

from __future__ import annotations

import threading
from typing import Any

import torch

from omni.transport.base import TensorConsumer, TensorProducer, TensorRef, TransportError

KINDS = ("shm", "tcp", "gloo", "nccl")
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", ""}


def _unknown(kind: str) -> TransportError:
    return TransportError(f"unknown transport {kind!r}; expected one of {', '.join(KINDS)}")


def make_producer(kind: str, host: str = "127.0.0.1", **opts: Any) -> TensorProducer:
    """kind "shm" (opts: arena_bytes, max_segments), "tcp" (port, token, max_tensor_bytes,
    advertise_host) or "gloo"/"nccl" (those plus timeout; the backend follows the tensor's device)."""
    if kind == "shm":
        from omni.transport.shm import ShmProducer
        return ShmProducer(host=host, **opts)
    if kind == "tcp":
        from omni.transport.tcp import TcpProducer
        return TcpProducer(host=host, **opts)
    if kind in ("gloo", "nccl"):
        from omni.transport.gloo import GlooProducer
        return GlooProducer(host=host, **opts)
    raise _unknown(kind)


def make_consumer(kind: str, **opts: Any) -> TensorConsumer:
    if kind == "shm":
        from omni.transport.shm import ShmConsumer
        return ShmConsumer(**opts)
    if kind == "tcp":
        from omni.transport.tcp import TcpConsumer
        return TcpConsumer(**opts)
    if kind in ("gloo", "nccl"):
        from omni.transport.gloo import GlooConsumer
        return GlooConsumer(**opts)
    raise _unknown(kind)


def choose_transport(producer_host: str, consumer_host: str, configured: str | None = None) -> str:
    """The configured transport wins; else shm on the same host and tcp across hosts."""
    if configured:
        if configured not in KINDS:
            raise _unknown(configured)
        return configured
    same = producer_host == consumer_host or (producer_host in _LOCAL_HOSTS and consumer_host in _LOCAL_HOSTS)
    return "shm" if same else "tcp"


class MultiConsumer(TensorConsumer):
    """Dispatches on `ref.transport`, building each transport's consumer on first use.
    `options` maps a transport name to its consumer's keyword arguments; `token` goes to
    every transport unless its options name one."""

    def __init__(self, options: dict[str, dict[str, Any]] | None = None, token: str | None = None):
        self._options = options or {}
        for kind in self._options:
            if kind not in KINDS:
                raise _unknown(kind)
        self._token = token
        self._lock = threading.Lock()
        self._consumers: dict[str, TensorConsumer] = {}

    def _consumer(self, kind: str) -> TensorConsumer:
        family = "gloo" if kind == "nccl" else kind
        with self._lock:
            consumer = self._consumers.get(family)
            if consumer is None:
                if kind not in KINDS:
                    raise _unknown(kind)
                opts = dict(self._options.get(family, {}))
                opts.setdefault("token", self._token)
                consumer = make_consumer(family, **opts)
                self._consumers[family] = consumer
            return consumer

    def get(self, ref: TensorRef) -> torch.Tensor:
        return self._consumer(ref.transport).get(ref)

    def close(self) -> None:
        with self._lock:
            consumers, self._consumers = self._consumers, {}
        for consumer in consumers.values():
            consumer.close()
