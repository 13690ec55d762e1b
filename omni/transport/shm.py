"""Shared-memory transport for one host: a producer-owned arena of memfd segments.

No names are created in /dev/shm: each segment is an anonymous `memfd_create` file,
handed to consumers over an abstract-namespace unix socket with SCM_RIGHTS, only to a peer
of the same user that passed the token hello ("OMS1", see server.py). The memory
goes away when the last process holding the fd or a mapping exits, so nothing leaks
even on SIGKILL. Each slot starts with a 64-byte header (magic, key, nbytes) that the
consumer checks, so a ref to a freed or foreign slot raises instead of returning
someone else's bytes. `get()` returns a zero-copy view: it stays valid until the
producer frees the slot (on ack), so consumers ack only after they are done with it.
Every view (`get`'s, `empty`'s) is made over a memoryview of the mapping, a buffer export that
refuses the mapping's close (torch.frombuffer holds none: a sweep's or close's munmap under a
view still read, a fetch thread's copy or an engine's input, crashed the process): the mapping
then goes with its last view.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import secrets
import socket
import struct
import threading

import torch

from omni.transport.alloc import ALIGN, round_up
from omni.transport.arena import ArenaProducer
from omni.transport.base import TensorConsumer, TensorRef, TransportError
from omni.transport.server import connect_same_user, same_user_server
from omni.transport.sweep import Sweep, listening
from omni.transport.util import check_ref, dtype_name, flat_bytes, plain, recv_exact

logger = logging.getLogger(__name__)

HEADER = ALIGN
_MAGIC = 0x4F4D4E4953484D31  # "OMNISHM1"
_SLOT = struct.Struct("<QQQ")  # magic, key, nbytes
_REQ = struct.Struct("<I")     # segment index
_REP = struct.Struct("<BQ")    # status (0 ok, 1 no such segment), segment size
DEFAULT_ARENA_BYTES = 256 << 20
MAGIC = b"OMS1"
_STATUS = struct.Struct("<B")  # hello reply: 0 ok, 1 refused


class _Segment:
    def __init__(self, index: int, size: int, tag: str):
        self.index = index
        self.size = size
        self.endpoint = f"{tag}/{index}"
        self.fd = os.memfd_create(f"omni-shm-{tag}-{index}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)

    def view(self, offset: int, count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        # frombuffer per call measured cheaper than slicing one whole-segment tensor (+ a dtype view);
        # through a memoryview, which holds the mapping open while the view lives (module docstring)
        return torch.frombuffer(memoryview(self.mm), dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        os.close(self.fd)


class ShmProducer(ArenaProducer):
    """Owns the arena. `arena_bytes` is the size of one segment (the largest tensor that
    fits, less a 64-byte header); up to `max_segments` segments are added as it fills."""

    transport = "shm"

    def __init__(self, arena_bytes: int = DEFAULT_ARENA_BYTES, max_segments: int = 4, host: str = "127.0.0.1",
                 token: str | None = None):
        if arena_bytes < 2 * HEADER or max_segments < 1:
            raise ValueError(f"shm arena_bytes must be >= {2 * HEADER} and max_segments >= 1")
        super().__init__(round_up(arena_bytes), max_segments, ALIGN, f"omni-shm-{os.getpid()}-{secrets.token_hex(4)}")
        self.host = host
        self._segments.append(_Segment(0, self.arena_bytes, self.name))   # more as it fills
        self._staged: dict[int, tuple[int, tuple[int, ...], torch.dtype]] = {}   # key -> (data_ptr, shape, dtype)
        self._server = same_user_server(self.name, socket.SOCK_STREAM, self._serve_fds, "omni-shm",
                                        magic=MAGIC, token=token, refusal=_STATUS.pack(1))

    # -- fd server -----------------------------------------------------------------------
    def _serve_fds(self, conn: socket.socket) -> None:
        """A peer of this user that passed the token hello (SocketServer checked both)."""
        conn.sendall(_STATUS.pack(0))
        while True:
            try:
                (index,) = _REQ.unpack(recv_exact(conn, _REQ.size))
            except ConnectionError:
                return
            with self._lock:
                seg = self._segments[index] if index < len(self._segments) and not self._closed else None
                if seg is None:
                    conn.sendall(_REP.pack(1, 0))
                else:
                    socket.send_fds(conn, [_REP.pack(0, seg.size)], [seg.fd])

    # -- producer API --------------------------------------------------------------------
    def put(self, tensor: torch.Tensor, owner: str = "") -> TensorRef:
        if not isinstance(tensor, torch.Tensor):
            raise TransportError(f"put() needs a torch.Tensor, got {type(tensor).__name__}")
        dtype = dtype_name(tensor.dtype)
        staged = self._take_staged(tensor) if self._staged else None
        if staged is not None:
            return staged
        src = plain(tensor)   # conj/neg views resolved: the bytes are the values
        nbytes = src.numel() * src.element_size()
        seg, off, key = self._reserve(nbytes, owner)
        try:
            if nbytes:
                seg.view(off + HEADER, nbytes).copy_(flat_bytes(src))
            # header last: a consumer never sees a valid header over half-written bytes
            _SLOT.pack_into(seg.mm, off, _MAGIC, key, nbytes)
        except Exception:
            self.free([key])
            raise
        return TensorRef(transport="shm", endpoint=seg.endpoint, key=key, dtype=dtype,
                         shape=tuple(src.shape), nbytes=nbytes, offset=off, owner=owner,
                         incarnation=self.incarnation)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, owner: str = "") -> torch.Tensor:
        """A tensor that lives in the arena: write the output into it (e.g. `out=`), then
        `put()` it and the hand-off copies nothing. Until put, it counts as in use; `free_owner`
        or `close` releases one that is never put."""
        dtype_name(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)   # put() of it sends just the header
        seg, off, key = self._reserve(nbytes, owner)
        out = seg.view(off + HEADER, math.prod(shape), dtype).view(shape)
        with self._lock:
            self._staged[key] = (out.data_ptr(), tuple(shape), dtype)
        return out

    def _take_staged(self, tensor: torch.Tensor) -> TensorRef | None:
        """The ref of a tensor from `empty()`, published without a copy; None for any other."""
        ptr, shape = tensor.data_ptr(), tuple(tensor.shape)
        with self._lock:
            for key, (sptr, sshape, sdtype) in self._staged.items():
                if sptr == ptr and sshape == shape and sdtype == tensor.dtype and tensor.is_contiguous():
                    del self._staged[key]
                    index, off, owner = self._book.slots[key]
                    nbytes = tensor.numel() * tensor.element_size()
                    _SLOT.pack_into(self._segments[index].mm, off, _MAGIC, key, nbytes)
                    return TensorRef(transport="shm", endpoint=self._segments[index].endpoint, key=key,
                                     dtype=dtype_name(tensor.dtype), shape=shape, nbytes=nbytes, offset=off,
                                     owner=owner, incarnation=self.incarnation)
        return None

    def _reserve(self, nbytes: int, owner: str) -> tuple[_Segment, int, int]:
        need = HEADER + nbytes
        if round_up(need) > self.arena_bytes:
            raise TransportError(
                f"tensor of {nbytes} bytes (+{HEADER} header) does not fit the shm arena segment of "
                f"{self.arena_bytes} bytes; raise arena_bytes"
            )
        return super()._reserve(need, owner)

    def _new_segment(self, index: int) -> _Segment:
        logger.debug("shm %s: adding segment %d", self.name, index)
        return _Segment(index, self.arena_bytes, self.name)

    def _cleared(self, key: int, segment: _Segment, offset: int) -> None:
        self._staged.pop(key, None)
        if not self._closed:
            _SLOT.pack_into(segment.mm, offset, 0, 0, 0)

    def _close_segment(self, segment: _Segment) -> None:
        segment.close()

    def close(self) -> None:
        super().close()
        with self._lock:
            self._staged.clear()


class ShmConsumer(TensorConsumer):
    """Maps each producer segment once (fd fetched over the producer's unix socket), until that
    producer is found gone (sweep.py)."""

    def __init__(self, connect_timeout: float = 10.0, token: str | None = None):
        self._timeout = connect_timeout
        self._token = token
        self._lock = threading.Lock()
        self._maps: dict[str, mmap.mmap] = {}
        self._sweep = Sweep()

    def get(self, ref: TensorRef) -> torch.Tensor:
        dtype = check_ref(ref, ("shm",))
        mm = self._segment(ref.endpoint)
        try:
            return self._view(ref, dtype, mm)
        except ValueError as e:   # "mmap closed": a sweep on another thread found its producer gone
            raise TransportError(f"shm ref key {ref.key}: producer of {ref.endpoint} is gone ({e})") from e

    def _view(self, ref: TensorRef, dtype: torch.dtype, mm: mmap.mmap) -> torch.Tensor:
        off = ref.offset
        if off < 0 or off % ALIGN or off + HEADER + ref.nbytes > len(mm):
            raise TransportError(
                f"shm ref key {ref.key}: offset {off} + {ref.nbytes} bytes is outside segment "
                f"{ref.endpoint} of {len(mm)} bytes"
            )
        magic, key, nbytes = _SLOT.unpack_from(mm, off)
        if magic != _MAGIC or key != ref.key or nbytes != ref.nbytes:
            raise TransportError(
                f"shm ref key {ref.key} at {ref.endpoint}+{off}: slot holds "
                + (f"key {key} ({nbytes} bytes)" if magic == _MAGIC else "nothing")
                + "; the tensor was freed or the ref is foreign"
            )
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        # the memoryview keeps a sweep from unmapping the segment under the view (module docstring)
        flat = torch.frombuffer(memoryview(mm), dtype=dtype, count=math.prod(ref.shape), offset=off + HEADER)
        return flat.view(ref.shape)

    def _segment(self, endpoint: str) -> mmap.mmap:
        with self._lock:
            if self._sweep.due() and self._maps:
                self._forget_gone()
            mm = self._maps.get(endpoint)
            if mm is None:
                mm = self._maps[endpoint] = self._fetch(endpoint)
            return mm

    def _forget_gone(self) -> None:
        """Let go of the segments of producers that no longer listen: each is unmapped now, or, while a
        tensor still views it (its memoryview refuses the close), when the last such view goes; the
        memory goes with the last mapping."""
        names = {e.rpartition("/")[0] for e in self._maps}
        gone = {n for n in names if not listening(n, socket.SOCK_STREAM)}
        for endpoint in [e for e in self._maps if e.rpartition("/")[0] in gone]:
            _unmap(self._maps.pop(endpoint))
        if gone:
            logger.info("shm: unmapped the segments of %d gone producer(s): %s", len(gone), ", ".join(sorted(gone)))

    def _fetch(self, endpoint: str) -> mmap.mmap:
        name, sep, index = endpoint.rpartition("/")
        if not sep or not index.isdigit() or not name.startswith("omni-shm-"):
            raise TransportError(f"bad shm endpoint {endpoint!r}, expected omni-shm-<pid>-<id>/<segment>")
        with connect_same_user(name, socket.SOCK_STREAM, MAGIC, self._token, self._timeout,
                               f"shm producer {name}") as sock:
            try:
                sock.sendall(_REQ.pack(int(index)))
                msg, fds, _flags, _addr = socket.recv_fds(sock, _REP.size, 1)
            except OSError as e:
                raise TransportError(f"shm producer {name} unreachable: {e}") from e
        if len(msg) != _REP.size:
            for fd in fds:
                os.close(fd)
            raise TransportError(f"shm producer {name} closed the connection (is it shutting down?)")
        status, size = _REP.unpack(msg)
        if status != 0 or not fds:
            raise TransportError(f"shm producer {name} has no segment {index}")
        try:
            return mmap.mmap(fds[0], size)
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for mm in maps.values():
            _unmap(mm)


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # tensors still view it; the mapping is released with them
