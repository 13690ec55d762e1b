"""TCP transport for other hosts: the producer keeps the tensor and serves its bytes.

Wire format (all little endian, no pickle):
  hello    server -> client  16-byte nonce
           client -> server  "OMT1" | HMAC-SHA256(token, "OMT1" | nonce) (within 5 s; checked in
           the accept thread, so an idle stranger costs no thread; server.py)
           server -> client  u8 status (0 ok, 1 bad token)
  request  client -> server  u64 key | u64 expected nbytes
  reply    server -> client  u8 status (0 ok, 1 unknown key, 2 size mismatch) | u64 nbytes | raw bytes
The consumer keeps a pool of open connections per endpoint and receives straight into
the buffer of a preallocated tensor (`recv_into`), from 1 MiB on a reused buffer whose
pages are present (recvpool.py); the producer sends from the tensor's memory
(`sendall(memoryview)`). Both ends read without blocking while bytes keep coming, and sleep
only after OMNI_SPIN_US with none (util.recv_into_exact).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading

import torch

from omni import envs
from omni.netaddr import host_port
from omni.transport.base import ProducerFull, TensorConsumer, TensorProducer, TensorRef, TransportError
from omni.transport.down import DownProducers
from omni.transport.recvpool import DEFAULT_POOL_BYTES, RecvPool
from omni.transport.server import SocketServer, client_hello, token_hello
from omni.transport.sweep import Sweep, closed_by_peer
from omni.transport.util import (
    as_memoryview, check_ref, dtype_name, prepare, recv_exact, recv_into_exact, split_endpoint,
)

logger = logging.getLogger(__name__)

MAGIC = b"OMT1"
STATUS = struct.Struct("<B")
REQ = struct.Struct("<QQ")
REP = struct.Struct("<BQ")
OK, UNKNOWN_KEY, SIZE_MISMATCH = 0, 1, 2
BAD_TOKEN = 1
DEFAULT_MAX_TENSOR_BYTES = 16 << 30
CONNECT_TIMEOUT_S = 5.0
# Bytes a producer keeps for consumers that have not acked yet; past it put() raises
# ProducerFull and the stage stops producing until consumers free (backpressure).
DEFAULT_MAX_BYTES_HELD = 1 << 30
_SMALL = 64 << 10


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class KeyedProducer(TensorProducer):
    """Holds tensors by key and serves them over a TCP control server. Subclasses
    change how the bytes travel (`_send_payload`) and what a connection sets up."""

    transport = "tcp"
    limit_name = "max_bytes_held"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, advertise_host: str | None = None,
                 max_bytes_held: int = DEFAULT_MAX_BYTES_HELD):
        self.host = host
        self.max_tensor_bytes = max_tensor_bytes
        self.max_bytes_held = max_bytes_held
        self._token = (token or "").encode()
        self._lock = threading.Lock()
        self._next_key = 1
        self._tensors: dict[int, tuple[torch.Tensor, str]] = {}
        self._by_owner: dict[str, set[int]] = {}
        self._bytes = 0
        self._closed = False
        self._spin_s = envs.OMNI_SPIN_US / 1e6   # a consumer's next request often follows at once
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=1024)
        bound_port = sock.getsockname()[1]
        adv = advertise_host or host
        self.endpoint = host_port(adv, bound_port)
        self.incarnation = f"{self.transport}-{os.getpid()}-{secrets.token_hex(4)}"   # a fixed port outlives a process
        self._server = SocketServer(sock, self._serve, f"omni-{self.transport}",
                                    hello=token_hello(MAGIC, self._token), refusal=STATUS.pack(BAD_TOKEN))

    # -- connection handling --------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        """A connection whose hello passed (SocketServer checked it)."""
        _tune(conn)
        conn.sendall(STATUS.pack(OK))
        state = self._on_connect(conn)
        try:
            while True:
                try:
                    key, want = REQ.unpack(recv_exact(conn, REQ.size, self._spin_s))
                except ConnectionError:
                    return
                with self._lock:
                    entry = self._tensors.get(key)
                if entry is None:
                    conn.sendall(REP.pack(UNKNOWN_KEY, 0))
                    continue
                tensor = entry[0]
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes != want:
                    conn.sendall(REP.pack(SIZE_MISMATCH, nbytes))
                    continue
                self._send_payload(conn, state, key, tensor, nbytes)
        finally:
            self._on_disconnect(state)

    def _on_connect(self, conn: socket.socket) -> object:
        return None

    def _on_disconnect(self, state: object) -> None:
        pass

    def _send_payload(self, conn: socket.socket, state: object, key: int, tensor: torch.Tensor, nbytes: int) -> None:
        head = REP.pack(OK, nbytes)
        if nbytes == 0:
            conn.sendall(head)
        elif nbytes <= _SMALL:
            conn.sendall(head + bytes(as_memoryview(tensor)))
        else:
            conn.sendall(head)
            conn.sendall(as_memoryview(tensor))

    # -- producer API --------------------------------------------------------------------
    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        return prepare(tensor, "cpu")

    def put(self, tensor: torch.Tensor, owner: str = "") -> TensorRef:
        """Keeps a reference (no copy for a contiguous CPU tensor): don't modify it in place
        until the consumer has acked it."""
        if not isinstance(tensor, torch.Tensor):
            raise TransportError(f"put() needs a torch.Tensor, got {type(tensor).__name__}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.max_tensor_bytes:
            raise TransportError(
                f"tensor of {nbytes} bytes exceeds the {self.transport} limit of {self.max_tensor_bytes} bytes "
                "(max_tensor_bytes)"
            )
        kept = self._keep(tensor)
        with self._lock:
            if self._closed:
                raise TransportError(f"{self.transport} producer {self.endpoint} is closed")
            if self._bytes + nbytes > self.max_bytes_held:
                if self._bytes == 0:
                    raise TransportError(
                        f"tensor of {nbytes} bytes exceeds the {self.transport} producer's limit of "
                        f"{self.max_bytes_held} bytes held (max_bytes_held)")
                raise ProducerFull(
                    f"{self.transport} producer {self.endpoint} holds {self._bytes} of {self.max_bytes_held} "
                    f"bytes, {nbytes} more needed; consumers must ack (free) tensors")
            key = self._next_key
            self._next_key += 1
            self._tensors[key] = (kept, owner)
            self._by_owner.setdefault(owner, set()).add(key)
            self._bytes += nbytes
        return TensorRef(transport=self._ref_transport(kept), endpoint=self.endpoint, key=key,
                         dtype=dtype_name(kept.dtype), shape=tuple(kept.shape), nbytes=nbytes, owner=owner,
                         incarnation=self.incarnation)

    def _ref_transport(self, tensor: torch.Tensor) -> str:
        return self.transport

    def free(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                entry = self._tensors.pop(key, None)
                if entry is None:
                    continue  # double ack or unknown key: freeing is idempotent
                tensor, owner = entry
                self._bytes -= tensor.numel() * tensor.element_size()
                owned = self._by_owner.get(owner)
                if owned is not None:
                    owned.discard(key)
                    if not owned:
                        del self._by_owner[owner]

    def free_owner(self, owner: str) -> None:
        with self._lock:
            keys = list(self._by_owner.get(owner, ()))
        self.free(keys)

    def bytes_in_use(self) -> int:
        with self._lock:
            return self._bytes

    def capacity_bytes(self) -> int:
        return self.max_bytes_held

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tensors.clear()
            self._by_owner.clear()
            self._bytes = 0
        self._server.close()


class TcpProducer(KeyedProducer):
    transport = "tcp"


def connect(endpoint: str, token: str | None, timeout: float) -> socket.socket:
    """Open a connection to a keyed producer and pass the hello; TransportError if refused."""
    host, port = split_endpoint(endpoint)
    try:
        # A producer answers a connect and its hello in milliseconds; one that does not is gone or
        # stopped (its kernel still accepts: the hello is what waits). Reads keep `timeout`.
        sock = socket.create_connection((host, port), timeout=min(timeout, CONNECT_TIMEOUT_S))
    except OSError as e:
        raise TransportError(f"producer {endpoint} unreachable: {e}") from e
    try:
        _tune(sock)
        client_hello(sock, MAGIC, token)
        (status,) = STATUS.unpack(recv_exact(sock, STATUS.size))
        sock.settimeout(timeout)
    except (OSError, ConnectionError) as e:
        sock.close()
        raise TransportError(f"producer {endpoint}: handshake failed: {e}") from e
    if status != OK:
        sock.close()
        raise TransportError(f"producer {endpoint} refused the connection: bad token")
    return sock


def request(sock: socket.socket, ref: TensorRef, spin_s: float = 0.0) -> int:
    """Ask for ref.key; returns the payload size or raises TransportError for a bad ref."""
    sock.sendall(REQ.pack(ref.key, ref.nbytes))
    status, nbytes = REP.unpack(recv_exact(sock, REP.size, spin_s))
    if status == UNKNOWN_KEY:
        raise TransportError(f"{ref.transport} producer {ref.endpoint} has no tensor with key {ref.key} "
                             "(freed or foreign ref)")
    if status == SIZE_MISMATCH:
        raise TransportError(f"{ref.transport} ref key {ref.key}: ref says {ref.nbytes} bytes, "
                             f"producer holds {nbytes}")
    if status != OK:
        raise TransportError(f"{ref.transport} producer {ref.endpoint}: bad reply status {status}")
    return nbytes


def drop_closed(idle: dict[str, list], sock_of, close) -> None:
    """Close the idle connections whose producer closed them (it is gone: sweep.py)."""
    for endpoint in list(idle):
        keep = []
        for conn in idle[endpoint]:
            if closed_by_peer(sock_of(conn)):
                close(conn)
            else:
                keep.append(conn)
        if keep:
            idle[endpoint] = keep
        else:
            del idle[endpoint]


class TcpConsumer(TensorConsumer):
    def __init__(self, token: str | None = None, timeout: float = 30.0,
                 max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, pool_bytes: int = DEFAULT_POOL_BYTES):
        self._token = token
        self._timeout = timeout
        self._max = max_tensor_bytes
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        self._closed = False
        self._pool = RecvPool(pool_bytes)
        self._spin_s = envs.OMNI_SPIN_US / 1e6
        self._sweep = Sweep()
        self._down = DownProducers()

    def _take(self, endpoint: str) -> socket.socket:
        self._down.check(endpoint)
        with self._lock:
            if self._closed:
                raise TransportError("tcp consumer is closed")
            if self._sweep.due():
                drop_closed(self._idle, lambda s: s, socket.socket.close)
            pool = self._idle.get(endpoint)
            if pool:
                return pool.pop()
        try:
            sock = connect(endpoint, self._token, self._timeout)
        except TransportError as e:
            if isinstance(e.__cause__, TimeoutError):
                self._down.mark(endpoint, "a connect timed out")
            raise
        self._down.clear(endpoint)
        return sock

    def _give(self, endpoint: str, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(endpoint, []).append(sock)
                return
        sock.close()

    def get(self, ref: TensorRef) -> torch.Tensor:
        dtype = check_ref(ref, ("tcp",))
        if ref.nbytes > self._max:
            raise TransportError(f"tcp ref key {ref.key}: {ref.nbytes} bytes exceeds this consumer's limit "
                                 f"of {self._max} bytes")
        sock = self._take(ref.endpoint)
        try:
            request(sock, ref, self._spin_s)
            out = self._pool.empty(ref.shape, dtype, ref.nbytes)
            if ref.nbytes:
                recv_into_exact(sock, as_memoryview(out), self._spin_s)
        except TransportError:
            self._give(ref.endpoint, sock)  # the connection is still in step
            raise
        except (OSError, ConnectionError) as e:
            sock.close()
            if isinstance(e, TimeoutError):
                self._down.mark(ref.endpoint, "a read timed out")
            raise TransportError(f"tcp producer {ref.endpoint}: transfer of key {ref.key} failed: {e}") from e
        except BaseException:
            sock.close()
            raise
        self._down.clear(ref.endpoint)
        self._give(ref.endpoint, sock)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._idle = self._idle, {}
        self._pool.clear()
        for pool in pools.values():
            for sock in pool:
                sock.close()
