"""A stage's tensor producers, one per transport kind, made on first use, and `auto`'s choice per
tensor: a CUDA tensor whose GPU the consuming stage also sees takes cuda_ipc; should cuda_ipc fail,
this process goes back to what the orchestrator sent, for that tensor and every later one. A tensor
cuda_ipc refuses by itself (TensorRefused: larger than a segment, on another GPU) goes that way alone.

gloo and nccl are one producer (a GlooProducer labels each ref by the tensor's device, "gloo" for
CPU, "nccl" for CUDA, whichever name the connector gave): producers are kept by family, so a
FreeTensors or a ref of either name reaches the producer that made it."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from omni.stage.worker_state import InFlight
from omni.transport.base import ProducerFull, TensorProducer, TensorRef, TensorRefused, TransportError
from omni.transport.factory import auto_transport

logger = logging.getLogger(__name__)


def family(kind: str) -> str:
    """The producer that serves refs of transport `kind` ("nccl" refs come from the gloo producer)."""
    return "gloo" if kind == "nccl" else kind


class OutputProducers:
    def __init__(self, make_producer: Callable[[str], TensorProducer] | None, devices: str, label: str,
                 available: frozenset[str] | None = None):
        self._make = make_producer
        self._by_kind: dict[str, TensorProducer] = {}
        self.devices, self.label = devices, label
        # transports this process can make beyond the sent one (cuda_ipc: a GPU); None: not looked yet
        self.available = available

    def get(self, kind: str) -> TensorProducer | None:
        return self._by_kind.get(family(kind))

    def producer(self, kind: str) -> TensorProducer:
        producer = self._by_kind.get(family(kind))
        if producer is None:
            if self._make is None:
                raise TransportError("this stage has no tensor producer")
            producer = self._by_kind[family(kind)] = self._make(kind)
        return producer

    def put(self, req: InFlight, tensor: Any, owner: str):
        kind = self.kind_for(req, tensor)
        if kind != req.out_transport:
            # auto's choice for this tensor (cuda_ipc). Should it fail here (it has not run on a GPU
            # yet), this process goes back to what the orchestrator sent, for this tensor and after.
            try:
                return self.producer(kind).put(tensor, owner=owner)
            except ProducerFull:
                raise
            except TensorRefused as e:      # this tensor only (too large, another GPU): the rest keep it
                logger.debug("%s: %s refused a tensor, %s carries it: %s", self.label, kind, req.out_transport, e)
            except TransportError as e:
                logger.warning("%s: %s failed, `auto` takes %s from now on: %s", self.label, kind,
                               req.out_transport, e)
                self.available = frozenset()
        return self.producer(req.out_transport).put(tensor, owner=owner)

    def put_all(self, req: InFlight, tensors: dict[str, Any], owner: str) -> dict[str, TensorRef]:
        """Refs of all of an output's tensors, or none: should a put raise (ProducerFull, or any
        error of a producer), the refs already made are freed and the error goes on."""
        refs: dict[str, TensorRef] = {}
        try:
            for name, tensor in tensors.items():
                refs[name] = self.put(req, tensor, owner)
        except ProducerFull:
            self.free_refs(refs)
            self._check_fits(req, tensors, self.carrier(req, tensor))
            raise
        except BaseException:
            self.free_refs(refs)
            raise
        return refs

    def _check_fits(self, req: InFlight, tensors: dict[str, Any], kind: str) -> None:
        """After `kind`'s producer was full for this output (its refs freed again): TransportError if
        the output can never fit there, so its request fails at once rather than holding the whole
        stage for stall_timeout_s: the producer holds nothing else (first-fit into the same empty
        arena fails the same way), or the output alone is over its capacity. Only the tensors it would
        carry count: one cuda_ipc refuses (larger than a segment, another GPU) is the sent transport's."""
        producer = self.producer(kind)
        mine = [t for t in tensors.values() if family(self.carrier(req, t)) == family(kind)]
        need = sum(t.numel() * t.element_size() for t in mine)
        cap = producer.capacity_bytes()
        if cap and need > cap:
            why = f"{need} bytes > {cap}"
        elif producer.bytes_in_use() == 0:
            why = f"{need} bytes in {len(mine)} tensors, in aligned slots, do not fit {cap} even empty"
        else:
            return
        where = "arena" if producer.limit_name == "arena_bytes" else "producer"
        raise TransportError(f"output too large for the connector's {kind} {where} ({why}): raise "
                             f"{producer.limit_name or 'its limit'}")

    def kind_for(self, req: InFlight, tensor: Any) -> str:
        """The request's transport, or cuda_ipc for a CUDA tensor where `auto` allows it."""
        if not req.out_devices or not getattr(tensor, "is_cuda", False):
            return req.out_transport
        if self.available is None:
            self.available = frozenset({"cuda_ipc"}) if torch.cuda.is_available() else frozenset()
        return auto_transport(True, str(tensor.device), self.devices, req.out_devices, self.available)

    def carrier(self, req: InFlight, tensor: Any) -> str:
        """Whose tensor it is: kind_for's choice, or the request's transport where that producer
        refuses this tensor by itself (put sends it there)."""
        kind = self.kind_for(req, tensor)
        producer = self.get(kind) if kind != req.out_transport else None
        if producer is not None and producer.refuses(tensor):
            return req.out_transport
        return kind

    def free_sent(self, transport: str, keys: list[int], incarnation: str) -> bool:
        """A FreeTensors: False (nothing freed) when its keys are another producer's, e.g. this
        replica's predecessor under the same id, whose keys started at 1 too."""
        producer = self.get(transport)
        if producer is None or incarnation not in ("", getattr(producer, "incarnation", "")):
            if producer is not None:
                logger.debug("%s: a free of %s keys of %s ignored (not this producer's)", self.label,
                             transport, incarnation)
            return False
        producer.free(keys)
        return True

    def free_refs(self, refs: dict) -> None:
        for r in refs.values():
            producer = self.get(r.transport)
            if producer is not None:
                producer.free([r.key])

    def free_owner(self, rid: str) -> None:
        for producer in self._by_kind.values():
            producer.free_owner(rid)

    def close(self) -> None:
        for producer in self._by_kind.values():
            try:
                producer.close()
            except Exception:
                logger.exception("closing a tensor producer")
        self._by_kind.clear()
