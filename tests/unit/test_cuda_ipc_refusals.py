"""`auto`'s cuda_ipc choice per tensor: a tensor cuda_ipc refuses by itself (larger than a segment,
on another GPU than the arena's) goes by the sent transport alone; a failure of the producer
(allocating or exporting a segment) turns cuda_ipc off for the process, as before."""

from __future__ import annotations

import types

import pytest
import torch

from omni.stage.producers import OutputProducers
from omni.stage.worker_state import InFlight
from omni.transport.base import TensorRefused, TransportError
from omni.transport.cuda_ipc import CudaIpcProducer

IPC = frozenset({"cuda_ipc"})
CUDA = types.SimpleNamespace(is_cuda=True, device="cuda:0")


def producers(error: Exception):
    puts: list[tuple[str, str]] = []

    class Ipc:
        def __init__(self):
            self.fail = True

        def put(self, tensor, owner=""):
            if self.fail:
                self.fail = False
                raise error
            puts.append(("cuda_ipc", owner))
            return "ipc-ref"

    class Shm:
        def put(self, tensor, owner=""):
            puts.append(("shm", owner))
            return "shm-ref"

    made = {"cuda_ipc": Ipc(), "shm": Shm()}
    return OutputProducers(made.__getitem__, "1", "talker", available=IPC), puts


@pytest.mark.parametrize("error", [
    TensorRefused("tensor of 70000000 bytes does not fit the cuda_ipc arena segment of 67108864 bytes"),
    TensorRefused("cuda_ipc arena is on cuda:0, the tensor on cuda:1"),
])
def test_a_tensor_cuda_ipc_refuses_goes_by_shm_alone(error):
    out, puts = producers(error)
    req = InFlight(b"f", 0.0, "shm", out_devices="1")
    assert out.put(req, CUDA, "r1") == "shm-ref"
    assert out.available == IPC and out.kind_for(req, CUDA) == "cuda_ipc"
    assert out.put(req, CUDA, "r2") == "ipc-ref"         # the next one still takes cuda_ipc
    assert puts == [("shm", "r1"), ("cuda_ipc", "r2")]


def test_a_failing_producer_turns_cuda_ipc_off():
    out, puts = producers(TransportError("cuda_ipc: allocating and exporting arena segment 0 failed: OOM"))
    req = InFlight(b"f", 0.0, "shm", out_devices="1")
    assert out.put(req, CUDA, "r1") == "shm-ref"
    assert out.available == frozenset() and out.put(req, CUDA, "r2") == "shm-ref"
    assert puts == [("shm", "r1"), ("shm", "r2")]


def test_the_producer_refuses_by_tensor():
    p = CudaIpcProducer(arena_bytes=1 << 16, max_segments=1, memory="host")
    try:
        with pytest.raises(TensorRefused, match="does not fit the cuda_ipc arena segment"):
            p.put(torch.zeros(1 << 15))                    # 128 KiB > one 64 KiB segment
        with pytest.raises(TensorRefused, match="takes CPU tensors"):
            p.put(torch.empty(4, device="meta"))           # not the arena's device
        assert p.put(torch.ones(4)).key                    # and still takes others
    finally:
        p.close()
