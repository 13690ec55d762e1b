"""torch.distributed transport: gloo for CPU tensors, NCCL for CUDA tensors.

The producer runs the tcp control server (tcp.py's hello/request/reply) plus the
rendezvous store (store.py: token hello, bounded, on the producer's address only; torch's
TCPStore has no authentication and listens on every interface). Each consumer connection
becomes a two-rank process group of its own
(producer rank 0, consumer rank 1; groups are built directly, no default group, so
one process can hold many). For a request the producer answers on the control
connection, then `send`s the tensor on that connection's group while the consumer
`recv`s into a preallocated tensor. CUDA tensors give refs with transport "nccl" and
travel on an NCCL group made lazily for the same pair; CPU tensors use gloo.

Extra wire step after the tcp hello: server -> client  u32 pair id | u16 store port | 16-byte nonce.
The pair's keys live under a prefix with that nonce and go when the connection closes.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import secrets
import socket
import struct
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from omni.transport.base import TensorConsumer, TensorRef, TransportError
from omni.transport.store import KeyValues, LocalStore, RemoteStore, StoreServer
from omni.transport.sweep import Sweep
from omni.transport.tcp import DEFAULT_MAX_TENSOR_BYTES, KeyedProducer, REP, OK, connect, drop_closed, request
from omni.transport.util import check_ref, prepare, recv_exact, split_endpoint

logger = logging.getLogger(__name__)

PAIR = struct.Struct("<IH16s")
PRODUCER_RANK, CONSUMER_RANK = 0, 1


def _tag(key: int) -> int:
    return key & 0x7FFFFFFF


def _make_group(backend: str, store: dist.Store, prefix: str, rank: int, host: str,
                timeout: datetime.timedelta) -> dist.ProcessGroup:
    store = dist.PrefixStore(f"{prefix}/{backend}/", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        opts._threads = 1
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if not dist.is_nccl_available():
        raise TransportError("a CUDA tensor needs NCCL, which this torch build lacks")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


@dataclass
class _Pair:
    """One consumer connection's process groups (gloo made at once, nccl on first use)."""

    prefix: str
    store: dist.Store
    host: str
    rank: int
    timeout: datetime.timedelta
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)

    def group(self, backend: str) -> dist.ProcessGroup:
        pg = self.groups.get(backend)
        if pg is None:
            pg = _make_group(backend, self.store, self.prefix, self.rank, self.host, self.timeout)
            self.groups[backend] = pg
        return pg


def _backend(transport: str) -> str:
    return "nccl" if transport == "nccl" else "gloo"


class GlooProducer(KeyedProducer):
    transport = "gloo"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, advertise_host: str | None = None,
                 timeout: float = 30.0):
        self._timeout = datetime.timedelta(seconds=timeout)
        self._pair_ids = itertools.count(1)
        self._store = StoreServer(KeyValues(timeout), host, (token or "").encode())
        self._group_host = advertise_host or host
        super().__init__(host, port, token, max_tensor_bytes, advertise_host)

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        # CUDA tensors stay on their GPU for NCCL; everything else goes to CPU for gloo
        return prepare(tensor, str(tensor.device) if tensor.is_cuda else "cpu")

    def _ref_transport(self, tensor: torch.Tensor) -> str:
        return "nccl" if tensor.is_cuda else "gloo"

    def _on_connect(self, conn: socket.socket) -> _Pair:
        pair_id = next(self._pair_ids)
        nonce = secrets.token_bytes(16)
        conn.sendall(PAIR.pack(pair_id, self._store.port, nonce))
        pair = _Pair(f"pair-{pair_id}-{nonce.hex()}", LocalStore(self._store.kv), self._group_host,
                     PRODUCER_RANK, self._timeout)
        try:
            pair.group("gloo")  # meets the consumer's half; fails after `timeout` if it never comes
        except BaseException:
            self._store.kv.drop_prefix(pair.prefix + "/")
            raise
        return pair

    def _on_disconnect(self, state: object) -> None:
        if isinstance(state, _Pair):
            state.groups.clear()
            self._store.kv.drop_prefix(state.prefix + "/")

    def _send_payload(self, conn: socket.socket, state: object, key: int, tensor: torch.Tensor, nbytes: int) -> None:
        assert isinstance(state, _Pair)
        conn.sendall(REP.pack(OK, nbytes))
        if nbytes:
            backend = "nccl" if tensor.is_cuda else "gloo"
            state.group(backend).send([tensor], CONSUMER_RANK, _tag(key)).wait()

    def close(self) -> None:
        super().close()
        self._store.close()


class _Conn:
    def __init__(self, sock: socket.socket, pair: _Pair):
        self.sock = sock
        self.pair = pair

    def close(self) -> None:
        self.sock.close()
        self.pair.groups.clear()
        self.pair.store.close()


class GlooConsumer(TensorConsumer):
    """Receives "gloo" refs into CPU tensors and "nccl" refs into tensors on `device`."""

    def __init__(self, token: str | None = None, timeout: float = 30.0,
                 max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, device: str | None = None):
        self._token = token
        self._timeout = timeout
        self._max = max_tensor_bytes
        self._device = device
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Conn]] = {}
        self._closed = False
        self._sweep = Sweep()

    def _open(self, endpoint: str) -> _Conn:
        sock = connect(endpoint, self._token, self._timeout)
        store = None
        try:
            pair_id, store_port, nonce = PAIR.unpack(recv_exact(sock, PAIR.size))
            host, _ = split_endpoint(endpoint)
            td = datetime.timedelta(seconds=self._timeout)
            # a store connection per pair: one blocked in a rendezvous would stall the others
            store = RemoteStore(host, store_port, self._token, self._timeout)
            pair = _Pair(f"pair-{pair_id}-{nonce.hex()}", store, sock.getsockname()[0], CONSUMER_RANK, td)
            pair.group("gloo")
        except BaseException as e:
            sock.close()
            if store is not None:
                store.close()
            if isinstance(e, TransportError):
                raise
            if isinstance(e, Exception):
                raise TransportError(f"gloo producer {endpoint}: group setup failed: {e}") from e
            raise
        return _Conn(sock, pair)

    def _take(self, endpoint: str) -> _Conn:
        with self._lock:
            if self._closed:
                raise TransportError("gloo consumer is closed")
            if self._sweep.due():   # and the process groups with them
                drop_closed(self._idle, lambda c: c.sock, _Conn.close)
            pool = self._idle.get(endpoint)
            if pool:
                return pool.pop()
        return self._open(endpoint)

    def _give(self, endpoint: str, conn: _Conn) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(endpoint, []).append(conn)
                return
        conn.close()

    def get(self, ref: TensorRef) -> torch.Tensor:
        dtype = check_ref(ref, ("gloo", "nccl"))
        if ref.nbytes > self._max:
            raise TransportError(f"{ref.transport} ref key {ref.key}: {ref.nbytes} bytes exceeds this "
                                 f"consumer's limit of {self._max} bytes")
        backend = _backend(ref.transport)
        device = (self._device or "cuda") if backend == "nccl" else "cpu"
        conn = self._take(ref.endpoint)
        try:
            request(conn.sock, ref)
            out = torch.empty(ref.shape, dtype=dtype, device=device)
            if ref.nbytes:
                conn.pair.group(backend).recv([out], PRODUCER_RANK, _tag(ref.key)).wait()
        except TransportError:
            self._give(ref.endpoint, conn)
            raise
        except Exception as e:
            conn.close()
            raise TransportError(f"{ref.transport} producer {ref.endpoint}: transfer of key {ref.key} "
                                 f"failed: {e}") from e
        self._give(ref.endpoint, conn)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._idle = self._idle, {}
        for pool in pools.values():
            for conn in pool:
                conn.close()
