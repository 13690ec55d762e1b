"""Pick, build and dispatch transports by name."""

from __future__ import annotations

import threading
from typing import Any

import torch

from omni.netaddr import is_loopback_ip
from omni.transport.base import TensorConsumer, TensorProducer, TensorRef, TransportError

KINDS = ("shm", "tcp", "gloo", "nccl", "cuda_ipc")
_LOCAL_NAMES = {"localhost", ""}


def _unknown(kind: str) -> TransportError:
    return TransportError(f"unknown transport {kind!r}; expected one of {', '.join(KINDS)}")


def make_producer(kind: str, host: str = "127.0.0.1", **opts: Any) -> TensorProducer:
    """kind "shm" (opts: arena_bytes, max_segments), "tcp" (port, token, max_tensor_bytes,
    advertise_host), "gloo"/"nccl" (those plus timeout; the backend follows the tensor's device) or
    "cuda_ipc" (arena_bytes, max_segments, memory "cuda" | "host", device)."""
    if kind == "cuda_ipc":
        from omni.transport.cuda_ipc import CudaIpcProducer
        return CudaIpcProducer(host=host, **opts)
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
    if kind == "cuda_ipc":
        from omni.transport.cuda_ipc import CudaIpcConsumer
        return CudaIpcConsumer(**opts)
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


def _local(host: str) -> bool:
    return host in _LOCAL_NAMES or is_loopback_ip(host)


def same_host(producer_host: str, consumer_host: str) -> bool:
    """Both this host: the same address, or both loopback (127.0.0.1 and ::1, as a master on ::1 has its stages
    advertise)."""
    return producer_host == consumer_host or (_local(producer_host) and _local(consumer_host))


def choose_transport(producer_host: str, consumer_host: str, configured: str | None = None) -> str:
    """The configured transport wins; else shm on the same host and tcp across hosts (a CUDA
    tensor may still take cuda_ipc at put time: `auto_transport`)."""
    if configured:
        if configured not in KINDS:
            raise _unknown(configured)
        return configured
    return auto_transport(same_host(producer_host, consumer_host))


def _gpus(devices: str) -> list[str] | None:
    """A stage's `devices` as the GPU indices it sees; None for "cpu" or unset (no restriction)."""
    devices = (devices or "").strip()
    if not devices or devices == "cpu":
        return None
    return [d.strip() for d in devices.split(",") if d.strip()]


def auto_transport(same_host: bool, tensor_device: str = "cpu", producer_devices: str = "cpu",
                   consumer_devices: str = "cpu", available: frozenset[str] | set[str] = frozenset()) -> str:
    """What `transport: auto` takes for one tensor (pure).

    Across hosts tcp. On one host: a CUDA tensor whose GPU the consumer stage also sees takes
    cuda_ipc, if this process has it (`available`); everything else shm (a CPU tensor, a consumer
    on another GPU or on the CPU, which wants host tensors). `tensor_device` is the tensor's
    device as this process names it ("cuda:1"); the stages' `devices` are indices into the same
    outer CUDA_VISIBLE_DEVICES (omni.stage.main.select_devices), so "cuda:1" in a stage with
    devices "2,3" is GPU 3, the same GPU as in a stage with devices "3"."""
    if not same_host:
        return "tcp"
    if not tensor_device.startswith("cuda") or "cuda_ipc" not in available:
        return "shm"
    consumer = _gpus(consumer_devices)
    if consumer is None:
        return "shm"
    _, _, index = tensor_device.partition(":")
    local = int(index) if index.isdigit() else 0
    producer = _gpus(producer_devices)
    if producer is None:
        gpu = str(local)
    elif local < len(producer):
        gpu = producer[local]
    else:
        return "shm"
    return "cuda_ipc" if gpu in consumer else "shm"


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
