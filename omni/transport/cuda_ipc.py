"""cuda_ipc: CUDA tensors between processes on one host and one GPU, by CUDA IPC.

NCCL refuses two ranks on one GPU, and device -> host shm -> device costs 59 ms for 256 MiB
(docs/transport-benchmarks.md). Here the producer owns an arena of device segments (slots
first-fit, freed on ack, as shm's; alloc.KeyedSlots); a consumer maps each segment once
(its IPC handle comes over the producer's unix socket on first use, with the producer's
interprocess event, the fence) and afterwards a TensorRef (segment, offset, dtype, shape) is
all that travels. Tensors are never pickled.

Ordering: `put` copies on the producer's copy stream (after the caller's stream) and records the
fence there; the caller's stream waits on the fence, so a later in-place write to the source comes
after the copy; the consumer's copy stream waits on the fence on the GPU, so no host waits for the
other's queue.
`get` returns a copy that the consumer owns, complete when `get` returns: the slot may then be
overwritten after the ack, whatever the consumer's own GPU queue still holds (a view read by a
kernel queued before the ack would race the producer's next copy into the slot).

Each segment has a slot table in host memory (a memfd the consumer maps read-only): magic, key,
nbytes per slot, written after the copy is queued and cleared on free, so a ref to a freed or
foreign slot raises, as shm's in-slot header does, without reading device memory. The consumer
checks it again after its copy, so a free that raced the copy raises instead of returning
overwritten bytes.

Which memory: `memory="cuda"` (device memory, ipc_memory.CudaMemory) or `"host"` (a memfd
stand-in, so the protocol runs in the CPU test suite through real processes and sockets).

Wire: abstract unix SEQPACKET at the producer's name; same user (SO_PEERCRED) + token hello
"OMC1" (server.py); then per request  consumer -> producer  u32 segment index,
producer -> consumer  one packet: msgpack Grant (ipc_memory.py) | the slot table's fd (+ the host
segment's fd), or u8 1 when there is no such segment. Endpoints: "HOST/NAME/SEGMENT".
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from omni.transport.alloc import round_up
from omni.transport.arena import ArenaProducer
from omni.transport.base import TensorConsumer, TensorRef, TensorRefused, TransportError
from omni.transport.ipc_memory import MEMORY, ArenaMemory, Grant, Mapping, Segment, make_memory
from omni.transport.server import connect_same_user, same_user_server
from omni.transport.sweep import Sweep, listening
from omni.transport.util import check_ref, dtype_name, flat_bytes, plain

logger = logging.getLogger(__name__)

MAGIC = b"OMC1"
ALIGN = 512                      # slot alignment in the device arena (CUDA allocations align to 256/512)
_ENTRY = struct.Struct("<QQQ")   # slot table entry: magic, key, nbytes
_TAG = 0x4F4D4E4943554431        # "OMNICUD1"
_REQ = struct.Struct("<I")
_STATUS = struct.Struct("<B")    # hello reply: 0 ok, 1 refused
_NONE = b"\x01"                  # reply: no such segment
DEFAULT_ARENA_BYTES = 64 << 20   # device memory: segments come one at a time, as the arena fills
MAX_GRANT_BYTES = 4096


@contextlib.contextmanager
def cuda_errors(what: str):
    """torch's CUDA errors (out of memory, an IPC handle refused) as TransportError with the step."""
    try:
        yield
    except RuntimeError as e:
        raise TransportError(f"cuda_ipc: {what} failed: {e}") from e


def table_bytes(segment_bytes: int) -> int:
    return round_up(segment_bytes // ALIGN * _ENTRY.size, mmap.PAGESIZE)


@dataclass
class _Seg:
    index: int
    mem: Segment
    table_fd: int
    table: mmap.mmap
    grant: bytes


class CudaIpcProducer(ArenaProducer):
    """`arena_bytes`: one segment (the largest tensor that fits); up to `max_segments` are made
    as it fills. `memory`: "cuda" (on `device`, default the current one) or "host" (the stand-in)."""

    transport = "cuda_ipc"

    def __init__(self, arena_bytes: int = DEFAULT_ARENA_BYTES, max_segments: int = 4, host: str = "127.0.0.1",
                 token: str | None = None, memory: str | ArenaMemory = "cuda", device: Any = None):
        if arena_bytes < ALIGN or max_segments < 1:
            raise ValueError(f"cuda_ipc arena_bytes must be >= {ALIGN} and max_segments >= 1")
        with cuda_errors("setting up the producer's memory"):
            self.memory = make_memory(memory, device)
            fence = self.memory.fence()
        super().__init__(round_up(arena_bytes, ALIGN), max_segments, ALIGN,
                         f"omni-ipc-{os.getpid()}-{secrets.token_hex(4)}")
        self.host = host
        self._prefix = f"{socket.gethostname()}/{self.name}/"
        self._fence = fence
        self._server = same_user_server(self.name, socket.SOCK_SEQPACKET, self._serve, "omni-cuda-ipc",
                                        magic=MAGIC, token=token, refusal=_STATUS.pack(1))

    def _serve(self, conn: socket.socket) -> None:
        """A peer of this user that passed the token hello: grants segments on request."""
        conn.sendall(_STATUS.pack(0))
        while True:
            req = conn.recv(_REQ.size)
            if len(req) != _REQ.size:
                return
            (index,) = _REQ.unpack(req)
            with self._lock:
                seg = self._segments[index] if index < len(self._segments) and not self._closed else None
                if seg is None:
                    conn.sendall(_NONE)
                else:
                    socket.send_fds(conn, [seg.grant], [seg.table_fd, *seg.mem.fds])

    def _new_segment(self, index: int) -> _Seg:
        with cuda_errors(f"allocating and exporting arena segment {index} ({self.arena_bytes} bytes)"):
            mem = self.memory.allocate(self.arena_bytes)
        fd = os.memfd_create(f"omni-ipc-table-{index}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, table_bytes(self.arena_bytes))
            table = mmap.mmap(fd, table_bytes(self.arena_bytes))
        except BaseException:
            os.close(fd)
            mem.close()
            raise
        grant = msgspec.msgpack.encode(Grant(index=index, size=self.arena_bytes, memory=self.memory.kind,
                                             device=self.memory.device_id(), handle=mem.handle, fence=self._fence))
        logger.debug("cuda_ipc %s: added segment %d (%d bytes, %s)", self.name, index, self.arena_bytes,
                     self.memory.kind)
        return _Seg(index, mem, fd, table, grant)

    def put(self, tensor: torch.Tensor, owner: str = "") -> TensorRef:
        if not isinstance(tensor, torch.Tensor):
            raise TransportError(f"put() needs a torch.Tensor, got {type(tensor).__name__}")
        dtype = dtype_name(tensor.dtype)
        why = self.refuses(tensor)
        if why:
            raise TensorRefused(why)
        src = plain(tensor)   # conj/neg views resolved: the bytes are the values
        nbytes = src.numel() * src.element_size()
        seg, off, key = self._reserve(nbytes, owner)
        try:
            if nbytes:
                with cuda_errors("the copy into the arena"):
                    self.memory.copy_in(seg.mem.buf[off:off + nbytes], flat_bytes(src))
            # the entry after the copy is queued: the fence recorded with it covers the bytes
            _ENTRY.pack_into(seg.table, off // ALIGN * _ENTRY.size, _TAG, key, nbytes)
        except Exception:
            self.free([key])
            raise
        return TensorRef(transport="cuda_ipc", endpoint=f"{self._prefix}{seg.index}", key=key, dtype=dtype,
                         shape=tuple(src.shape), nbytes=nbytes, offset=off, owner=owner,
                         incarnation=self.incarnation)

    def refuses(self, tensor: torch.Tensor) -> str:
        try:
            self.memory.check(tensor)
        except TransportError as e:     # its device: this tensor's matter, not the producer's
            return str(e)
        nbytes = tensor.numel() * tensor.element_size()
        if round_up(max(nbytes, 1), ALIGN) > self.arena_bytes:
            return (f"tensor of {nbytes} bytes does not fit the cuda_ipc arena segment of {self.arena_bytes} "
                    "bytes; raise arena_bytes")
        return ""

    def _cleared(self, key: int, segment: _Seg, offset: int) -> None:
        if not self._closed:
            _ENTRY.pack_into(segment.table, offset // ALIGN * _ENTRY.size, 0, 0, 0)

    def _close_segment(self, segment: _Seg) -> None:
        segment.mem.close()
        segment.table.close()
        os.close(segment.table_fd)

    def close(self) -> None:
        super().close()
        self.memory.close()


@dataclass
class _Opened:
    grant: Grant
    mapping: Mapping
    table: mmap.mmap
    fence: Any


class CudaIpcConsumer(TensorConsumer):
    """Maps each producer segment once, until that producer is found gone (sweep.py); `get` copies
    the slot into a tensor of its own."""

    def __init__(self, connect_timeout: float = 10.0, token: str | None = None):
        self._timeout = connect_timeout
        self._token = token
        self._lock = threading.Lock()
        self._host = socket.gethostname()
        self._segments: dict[str, _Opened] = {}
        self._fences: dict[str, Any] = {}          # producer name -> its opened fence
        self._memory: dict[str, ArenaMemory] = {}  # "cuda" | "host" -> the consumer side of it
        self._sweep = Sweep()

    def get(self, ref: TensorRef) -> torch.Tensor:
        dtype = check_ref(ref, ("cuda_ipc",))
        seg = self._segment(ref.endpoint)
        off = ref.offset
        if off < 0 or off % ALIGN or off + ref.nbytes > seg.grant.size:
            raise TransportError(f"cuda_ipc ref key {ref.key}: offset {off} + {ref.nbytes} bytes is outside "
                                 f"segment {ref.endpoint} of {seg.grant.size} bytes")
        memory = self._memory[seg.grant.memory]
        try:
            self._check_entry(seg, ref)
            with cuda_errors(f"the copy out of {ref.endpoint}"):
                out = memory.copy_out(seg.mapping, seg.fence, off, dtype, ref.shape)
            self._check_entry(seg, ref)   # freed (and maybe reused) while it was copied: not these bytes
        except ValueError as e:   # "mmap closed": a sweep on another thread found its producer gone
            raise TransportError(f"cuda_ipc ref key {ref.key}: producer of {ref.endpoint} is gone ({e})") from e
        return out

    def _check_entry(self, seg: _Opened, ref: TensorRef) -> None:
        tag, key, nbytes = _ENTRY.unpack_from(seg.table, ref.offset // ALIGN * _ENTRY.size)
        if tag != _TAG or key != ref.key or nbytes != ref.nbytes:
            raise TransportError(
                f"cuda_ipc ref key {ref.key} at {ref.endpoint}+{ref.offset}: slot holds "
                + (f"key {key} ({nbytes} bytes)" if tag == _TAG else "nothing")
                + "; the tensor was freed or the ref is foreign")

    def _segment(self, endpoint: str) -> _Opened:
        with self._lock:
            if self._sweep.due() and self._segments:
                self._forget_gone()
            seg = self._segments.get(endpoint)
            if seg is None:
                seg = self._segments[endpoint] = self._open(endpoint)
            return seg

    def _forget_gone(self) -> None:
        """Unmap the segments (and fence) of producers that no longer listen: a dead producer's
        device memory stays allocated while a consumer maps it."""
        names = {_split(e)[1] for e in self._segments}
        gone = {n for n in names if not listening(n, socket.SOCK_SEQPACKET)}
        for endpoint in [e for e in self._segments if _split(e)[1] in gone]:
            _release(self._segments.pop(endpoint))
        for name in gone:
            self._fences.pop(name, None)
        if gone:
            logger.info("cuda_ipc: unmapped the segments of %d gone producer(s): %s", len(gone),
                        ", ".join(sorted(gone)))

    def _open(self, endpoint: str) -> _Opened:
        host, name, index = _split(endpoint)
        if host != self._host:
            raise TransportError(f"cuda_ipc producer {name} runs on host {host!r}, this consumer on {self._host!r}: "
                                 "cuda_ipc works within one host (other hosts: tcp, gloo or nccl)")
        msg, fds = self._fetch(name, index)
        try:
            grant = msgspec.msgpack.decode(msg, type=Grant)
            if grant.memory not in MEMORY or grant.index != index or not fds:
                raise TransportError(f"cuda_ipc producer {name} sent a bad grant for segment {index}")
            with cuda_errors(f"mapping segment {index} of {name}"):
                memory = self._memory.get(grant.memory)
                if memory is None:
                    memory = self._memory[grant.memory] = make_memory(grant.memory)
                mapping = memory.open(grant, fds[1:])
                fence = self._fences.get(name)
                if fence is None:
                    fence = self._fences[name] = memory.open_fence(grant)
            table = mmap.mmap(fds[0], table_bytes(grant.size), prot=mmap.PROT_READ)
        except msgspec.DecodeError as e:
            raise TransportError(f"cuda_ipc producer {name}: undecodable grant: {e}") from e
        finally:
            for fd in fds:   # the mappings outlive their fds
                os.close(fd)
        return _Opened(grant, mapping, table, fence)

    def _fetch(self, name: str, index: int) -> tuple[bytes, list[int]]:
        with connect_same_user(name, socket.SOCK_SEQPACKET, MAGIC, self._token, self._timeout,
                               f"cuda_ipc producer {name}") as sock:
            try:
                sock.send(_REQ.pack(index))
                msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_GRANT_BYTES, 4)
            except OSError as e:
                raise TransportError(f"cuda_ipc producer {name} unreachable: {e}") from e
        if msg == _NONE or not msg:
            for fd in fds:
                os.close(fd)
            raise TransportError(f"cuda_ipc producer {name} has no segment {index}"
                                 + ("" if msg else " (it closed the connection: shutting down?)"))
        return msg, fds

    def close(self) -> None:
        with self._lock:
            segments, self._segments = self._segments, {}
            self._fences.clear()
        for seg in segments.values():
            _release(seg)


def _release(seg: _Opened) -> None:
    seg.table.close()
    seg.mapping.close()


def _split(endpoint: str) -> tuple[str, str, int]:
    host, _, rest = endpoint.partition("/")
    name, _, index = rest.partition("/")
    if not host or not name.startswith("omni-ipc-") or not index.isdigit():
        raise TransportError(f"bad cuda_ipc endpoint {endpoint!r}, expected HOST/omni-ipc-<pid>-<id>/<segment>")
    return host, name, int(index)
