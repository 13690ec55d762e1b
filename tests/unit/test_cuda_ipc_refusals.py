"""`auto`'s cuda_ipc choice per tensor: a tensor cuda_ipc refuses by itself (larger than a segment,
on another GPU than the arena's) goes by the sent transport alone; a failure of the producer
(allocating or exporting a segment) turns cuda_ipc off for the process, as before."""

from __future__ import annotations

import types

import pytest
import torch

from omni.stage.producers import OutputProducers
from omni.stage.worker_state import InFlight
from omni.transport.base import ProducerFull, TensorRefused, TransportError
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


# An output's fit (producers._check_fits, after a ProducerFull) counts only the tensors the full producer
# carries: one cuda_ipc refuses goes by the sent transport, and so is that transport's.
SEG, ARENA = 64 << 20, 4 * (64 << 20)


class Sized(types.SimpleNamespace):
    """A CUDA tensor of `n` bytes (only its size is read)."""
    is_cuda, device = True, "cuda:0"

    def element_size(self):
        return 1

    def numel(self):
        return self.n


class Arena:
    """cuda_ipc with earlier outputs still unread: it refuses what is over a segment, and is full."""
    limit_name = "arena_bytes"

    def __init__(self, capacity: int, full: bool, segment: int = 0):
        self.capacity, self.full, self.segment, self.freed = capacity, full, segment, []

    def refuses(self, t):
        return f"tensor of {t.n} bytes does not fit a segment" if self.segment and t.n > self.segment else ""

    def put(self, t, owner=""):
        if self.refuses(t):
            raise TensorRefused(self.refuses(t))
        if self.full:
            raise ProducerFull("arena busy: consumers have not freed yet")
        return types.SimpleNamespace(transport="shm", key=t.n)

    def capacity_bytes(self):
        return self.capacity

    def bytes_in_use(self):
        return self.capacity - (1 << 20) if self.full else 0

    def free(self, keys):
        self.freed += keys


@pytest.mark.parametrize("order", ["refused first", "refused last"])
def test_a_refused_tensor_does_not_count_against_the_full_arena(order):
    """Before: the 300 MiB tensor cuda_ipc refused (shm carries it) counted as cuda_ipc's, so the output
    was 'too large for the connector's cuda_ipc arena (315621376 bytes > 268435456)' and its request
    failed, where the 1 MiB one only waits for frees."""
    made = {"cuda_ipc": Arena(ARENA, full=True, segment=SEG), "shm": Arena(0, full=False)}
    out = OutputProducers(made.__getitem__, "1", "dit", available=IPC)
    req = InFlight(b"f", 0.0, "shm", out_devices="1")
    tensors = {"frames": Sized(n=300 << 20), "mask": Sized(n=1 << 20)}
    if order == "refused last":
        tensors = dict(reversed(tensors.items()))
    with pytest.raises(ProducerFull):
        out.put_all(req, tensors, "r1")
    assert made["shm"].freed == ([300 << 20] if order == "refused first" else [])   # all or none


def test_the_full_producer_is_the_one_that_carries_the_refused_tensor():
    """cuda_ipc refuses the tensor and shm is full for it: shm's fit is checked (it holds 1 GiB),
    not cuda_ipc's. Before: 'too large for the connector's cuda_ipc arena'."""
    made = {"cuda_ipc": Arena(ARENA, full=False, segment=SEG), "shm": Arena(1 << 30, full=True)}
    out = OutputProducers(made.__getitem__, "1", "dit", available=IPC)
    req = InFlight(b"f", 0.0, "shm", out_devices="1")
    with pytest.raises(ProducerFull):
        out.put_all(req, {"frames": Sized(n=300 << 20)}, "r1")
    made["shm"].capacity = 256 << 20        # and over shm's own capacity it fails, naming shm
    with pytest.raises(TransportError, match="connector's shm arena .314572800 bytes > 268435456"):
        out.put_all(req, {"frames": Sized(n=300 << 20)}, "r1")


def test_the_producer_says_what_it_refuses():
    p = CudaIpcProducer(arena_bytes=1 << 16, max_segments=1, memory="host")
    try:
        assert "does not fit the cuda_ipc arena segment" in p.refuses(torch.zeros(1 << 15))
        assert "takes CPU tensors" in p.refuses(torch.empty(4, device="meta"))
        assert p.refuses(torch.ones(4)) == ""
    finally:
        p.close()
