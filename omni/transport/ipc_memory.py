"""The memory behind a cuda_ipc arena, one class per kind: CUDA device memory, and host memory
that stands in for it where there is no GPU (the CPU test suite, benchmarks on CPU).

cuda_ipc.py runs the same protocol on either; only these few operations differ:
  producer  allocate(n) -> Segment (its buffer + what a consumer needs to map it), fence()
            (exported once), copy_in(dst, src) (the copy into a slot, ordered by the fence)
  consumer  open(grant, fds) -> Mapping (the segment's buffer in this process), open_fence(grant)
            (once per producer), copy_out(mapping, fence, offset, dtype, shape) (a tensor of the
            consumer's own, complete when
            it returns, so the producer may reuse the slot after the ack whatever the consumer's
            GPU queue still holds)
"""

from __future__ import annotations

import abc
import math
import mmap
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from omni.transport.base import TransportError
from omni.transport.recvpool import RecvPool


class Grant(msgspec.Struct, frozen=True, kw_only=True):
    """The producer's answer to a consumer that asks for segment `index` (msgpack, with fds)."""
    index: int
    size: int                 # bytes in the segment
    memory: str               # "cuda" | "host": which class maps it
    device: str               # the device's identity (a GPU's UUID, or the host's name)
    handle: bytes = b""       # what maps the memory (CUDA: an encoded CudaShare); host memory: the fd
    fence: bytes = b""        # the producer's interprocess event (CUDA only)


class CudaShare(msgspec.Struct, frozen=True, array_like=True):
    """torch's `UntypedStorage._share_cuda_()` tuple, for `_new_shared_cuda` on the other side
    (torch leaves the event handle out when no sync is required)."""
    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes | None
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


@dataclass
class Segment:
    """A producer's segment: `buf` is a flat uint8 tensor; `fds` travel with its grant."""
    buf: torch.Tensor
    handle: bytes = b""
    fds: list[int] = field(default_factory=list)
    keep: Any = None          # what must outlive the buffer (the host mapping)

    def close(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if isinstance(self.keep, mmap.mmap):
            try:
                self.keep.close()
            except BufferError:
                pass   # a view is still alive somewhere; the mapping goes with it


@dataclass
class Mapping:
    """A consumer's view of one producer segment."""
    buf: torch.Tensor
    keep: Any = None

    def close(self) -> None:
        """Let go of the segment (its memory goes once the producer and every mapping have)."""
        self.buf = torch.empty(0, dtype=torch.uint8)
        keep, self.keep = self.keep, None
        if isinstance(keep, mmap.mmap):
            try:
                keep.close()
            except BufferError:
                pass   # a view is still alive somewhere; the mapping goes with it


class ArenaMemory(abc.ABC):
    kind: str

    @abc.abstractmethod
    def device_id(self) -> str: ...

    @abc.abstractmethod
    def check(self, tensor: torch.Tensor) -> None:
        """TransportError unless this memory can take `tensor` (its device)."""

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> Segment: ...

    def fence(self) -> bytes:
        return b""

    @abc.abstractmethod
    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def open(self, grant: Grant, fds: list[int]) -> Mapping:
        """Map a granted segment; `fds` stay the caller's (closed after this returns)."""

    def open_fence(self, grant: Grant) -> Any:
        return None

    @abc.abstractmethod
    def copy_out(self, mapping: Mapping, fence: Any, offset: int, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> torch.Tensor: ...

    def close(self) -> None:
        pass


def _wrong_device(grant: Grant, mine: str) -> TransportError:
    return TransportError(
        f"cuda_ipc segment {grant.index} lives on {grant.device}, which this process cannot map (it has {mine}): "
        "cuda_ipc needs producer and consumer on one host and one GPU; other pairs take shm, nccl or tcp")


class HostMemory(ArenaMemory):
    """Host memory in the place of a GPU's: a memfd per segment, its fd handed to the consumer
    (SCM_RIGHTS), copies by the CPU. `device` names the 'device' (default: this host), so a
    test can make a producer whose memory a consumer must refuse."""

    kind = "host"

    def __init__(self, device: str | None = None):
        self._device = device or f"host {socket.gethostname()}"
        # copies out land in reused, prefaulted buffers, as tcp's receives (a fresh 256 MiB tensor
        # faults in every page: 7x the copy); CUDA's caching allocator does the same for device memory
        self._pool = RecvPool()

    def device_id(self) -> str:
        return self._device

    def check(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise TransportError(f"cuda_ipc with host memory (the stand-in) takes CPU tensors, got one on {tensor.device}")

    def allocate(self, nbytes: int) -> Segment:
        fd = os.memfd_create("omni-ipc-host", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        return Segment(torch.frombuffer(memoryview(mm), dtype=torch.uint8), fds=[fd], keep=mm)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def open(self, grant: Grant, fds: list[int]) -> Mapping:
        if grant.device != self._device:
            raise _wrong_device(grant, self._device)
        if len(fds) != 1:
            raise TransportError(f"cuda_ipc host segment {grant.index}: expected 1 fd, got {len(fds)}")
        mm = mmap.mmap(fds[0], grant.size)
        # through a memoryview: while a slice of buf lives (a copy_out on another thread), the
        # mapping's close is refused, not an munmap under the copy (torch.frombuffer holds no export)
        return Mapping(torch.frombuffer(memoryview(mm), dtype=torch.uint8), keep=mm)

    def copy_out(self, mapping: Mapping, fence: Any, offset: int, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        out = self._pool.empty(shape, dtype, nbytes)
        out.view(-1).view(torch.uint8).copy_(mapping.buf[offset:offset + nbytes])
        return out


class CudaMemory(ArenaMemory):
    """Device memory shared by CUDA IPC. The producer copies into a slot on its own copy stream
    (after the caller's stream, so the source is computed) and records one interprocess event
    there, which the caller's stream then waits on (a later in-place write to the source comes after
    the copy); the consumer's copy stream waits on that event on the GPU, so neither host blocks
    for the other's queue. One event serves every put: all are recorded on the one copy stream, so the
    latest record comes after every copy before it."""

    kind = "cuda"

    def __init__(self, device: int | str | torch.device | None = None):
        if not torch.cuda.is_available():
            raise TransportError("cuda_ipc needs a CUDA GPU, and torch sees none here "
                                 "(a CPU build of torch, or no GPU visible)")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise TransportError(f"cuda_ipc memory must be on a CUDA device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._streams: dict[int, torch.cuda.Stream] = {}   # a copy stream per device
        self._event: torch.cuda.Event | None = None        # the producer's fence, made on first use

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        return stream

    def _fence(self) -> torch.cuda.Event:
        if self._event is None:
            with torch.cuda.device(self.device):
                self._event = torch.cuda.Event(interprocess=True)
                self._event.record(self._stream(self.device))
        return self._event

    def device_id(self) -> str:
        return f"GPU {torch.cuda.get_device_properties(self.device).uuid}"

    def check(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cuda":
            raise TransportError(f"cuda_ipc carries CUDA tensors; this one is on {tensor.device} (shm or tcp carry those)")
        if tensor.device != self.device:
            raise TransportError(f"cuda_ipc arena is on {self.device}, the tensor on {tensor.device}")

    def allocate(self, nbytes: int) -> Segment:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        share = CudaShare(*buf.untyped_storage()._share_cuda_())
        return Segment(buf, handle=msgspec.msgpack.encode(share))

    def fence(self) -> bytes:
        return bytes(self._fence().ipc_handle())

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream, event = self._stream(self.device), self._fence()
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)    # the copy comes after the work that computed src
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event.record(stream)
        # ... and the caller's later work (an in-place write into src) after the copy: on the GPU,
        # no host wait. The event's record of this put is the one waited on.
        current.wait_event(event)
        src.record_stream(stream)   # the caller may drop src before the copy has run

    def open(self, grant: Grant, fds: list[int]) -> Mapping:
        index = self._local_index(grant)
        share = msgspec.msgpack.decode(grant.handle, type=CudaShare)
        if share.size < grant.size:
            raise TransportError(f"cuda_ipc segment {grant.index}: the shared storage has {share.size} bytes, "
                                 f"the grant says {grant.size}")
        storage = torch.UntypedStorage._new_shared_cuda(
            index, share.handle, share.size, share.offset, share.ref_counter_handle, share.ref_counter_offset,
            share.event_handle, share.event_sync_required)
        buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (grant.size,), (1,))
        return Mapping(buf, keep=storage)

    def open_fence(self, grant: Grant) -> torch.cuda.Event:
        return torch.cuda.Event.from_ipc_handle(self._local_index(grant), grant.fence)

    def _local_index(self, grant: Grant) -> int:
        """This process's index of the producer's GPU (the two may see different CUDA_VISIBLE_DEVICES)."""
        seen = [f"GPU {torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count())]
        if grant.device not in seen:
            raise _wrong_device(grant, ", ".join(seen) or "no GPU")
        return seen.index(grant.device)

    def copy_out(self, mapping: Mapping, fence: Any, offset: int, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> torch.Tensor:
        buf = mapping.buf   # once: a sweep's close on another thread swaps it for an empty one
        device = buf.device
        stream, current = self._stream(device), torch.cuda.current_stream(device)
        nbytes = math.prod(shape) * dtype.itemsize
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            # out comes from the copy stream's pool: one from the caller's could be a block freed there
            # that the caller's queued kernels still use, which this copy (ordered by the fence only)
            # would overwrite. The caller's stream is recorded, so the block waits for its work when freed.
            out = torch.empty(shape, dtype=dtype, device=device)
            out.record_stream(current)
            stream.wait_event(fence)
            out.view(-1).view(torch.uint8).copy_(buf[offset:offset + nbytes], non_blocking=True)
            done.record(stream)
        # Wait for this copy only (not for the consumer's other work): once get() returns, the
        # slot's bytes are out, and the producer may overwrite it after the ack.
        done.synchronize()
        return out


MEMORY = {"cuda": CudaMemory, "host": HostMemory}


def make_memory(memory: str | ArenaMemory, device: Any = None) -> ArenaMemory:
    if isinstance(memory, ArenaMemory):
        return memory
    if memory not in MEMORY:
        raise TransportError(f"cuda_ipc memory {memory!r} is not supported; expected one of {', '.join(MEMORY)}")
    return CudaMemory(device) if memory == "cuda" else HostMemory(device)
