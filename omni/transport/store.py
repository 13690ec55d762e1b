"""The rendezvous store of the gloo/NCCL transport: torch's TCPStore replaced by one that
asks for the token.

torch's TCPStore has no authentication and listens on every interface, so anyone who can
reach its port can list its keys or grow it with large values. Here the producer keeps the
keys in process (`LocalStore`) and serves them to consumers over a SocketServer with the
same token hello as the tensor server ("OMG1"), bound to the producer's address only.
Keys, values and the number of entries are bounded.

Wire (little endian): request  u8 op | u16 key bytes | u32 value bytes | key | value
                      reply    u8 status | u32 value bytes | value
Keys of WAIT/CHECK are joined by NUL. GET and WAIT block until the keys exist or the
store's timeout passes (status TIMEOUT).
"""

from __future__ import annotations

import socket
import struct
import threading

import torch.distributed as dist

from omni.netaddr import host_port
from omni.transport.base import TransportError
from omni.transport.server import SocketServer, client_hello, token_hello
from omni.transport.util import recv_exact

MAGIC = b"OMG1"
REQ = struct.Struct("<BHI")
REP = struct.Struct("<BI")
STATUS = struct.Struct("<B")
SET, GET, ADD, WAIT, CHECK, DELETE = 1, 2, 3, 4, 5, 6
OK, TIMEOUT, ERROR = 0, 1, 2
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 10
MAX_ENTRIES = 4096


class StoreError(ValueError):
    pass


class KeyValues:
    """The producer's keys: bounded, with waiters."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:
            raise StoreError(f"store value of {len(value)} bytes; the limit is {MAX_VALUE_BYTES}")
        with self._cond:
            if key not in self._data and len(self._data) >= MAX_ENTRIES:
                raise StoreError(f"store holds {MAX_ENTRIES} keys, the limit")
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes | None:
        with self._cond:
            if self._cond.wait_for(lambda: key in self._data, self.timeout_s):
                return self._data[key]
        return None

    def add(self, key: str, n: int) -> int:
        with self._cond:   # an RLock: set() takes it again
            value = int(self._data.get(key, b"0")) + n
            self.set(key, str(value).encode())
        return value

    def wait(self, keys: list[str], timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: all(k in self._data for k in keys),
                                       self.timeout_s if timeout_s is None else timeout_s)

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def drop_prefix(self, prefix: str) -> None:
        with self._cond:
            for k in [k for k in self._data if k.startswith(prefix)]:
                del self._data[k]


def _value(v) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


class LocalStore(dist.Store):
    """The producer's side of a rendezvous: the keys directly."""

    def __init__(self, kv: KeyValues):
        super().__init__()
        self._kv = kv

    def set(self, key, value):
        self._kv.set(key, _value(value))

    def get(self, key):
        value = self._kv.get(key)
        if value is None:
            raise TimeoutError(f"store key {key!r} did not appear within {self._kv.timeout_s:.0f} s")
        return value

    def add(self, key, n):
        return self._kv.add(key, n)

    def wait(self, keys, timeout=None):
        if not self._kv.wait(list(keys), timeout.total_seconds() if timeout else None):
            raise TimeoutError(f"store keys {list(keys)} did not appear in time")

    def check(self, keys):
        return self._kv.check(list(keys))

    def delete_key(self, key):
        return self._kv.delete(key)


class StoreServer:
    """Serves `kv` to consumers that pass the token hello."""

    def __init__(self, kv: KeyValues, host: str, token: bytes):
        self.kv = kv
        sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=1024)
        self.port = sock.getsockname()[1]
        self._server = SocketServer(sock, self._serve, "omni-gloo-store", hello=token_hello(MAGIC, token),
                                    refusal=STATUS.pack(1))

    def _serve(self, conn: socket.socket) -> None:
        conn.sendall(STATUS.pack(OK))
        while True:
            try:
                op, klen, vlen = REQ.unpack(recv_exact(conn, REQ.size))
            except ConnectionError:
                return
            if klen > MAX_KEY_BYTES or vlen > MAX_VALUE_BYTES:
                conn.sendall(self._reply(ERROR, b"key or value too large"))
                return   # the rest of the request is not read: the connection is done
            key = recv_exact(conn, klen).decode(errors="replace")
            value = recv_exact(conn, vlen)
            conn.sendall(self._handle(op, key, value))

    def _handle(self, op: int, key: str, value: bytes) -> bytes:
        try:
            if op == SET:
                self.kv.set(key, value)
                return self._reply(OK)
            if op == GET:
                got = self.kv.get(key)
                return self._reply(TIMEOUT) if got is None else self._reply(OK, got)
            if op == ADD:
                return self._reply(OK, struct.pack("<q", self.kv.add(key, struct.unpack("<q", value)[0])))
            if op == WAIT:
                return self._reply(OK if self.kv.wait(key.split("\0")) else TIMEOUT)
            if op == CHECK:
                return self._reply(OK, STATUS.pack(self.kv.check(key.split("\0"))))
            if op == DELETE:
                return self._reply(OK, STATUS.pack(self.kv.delete(key)))
            return self._reply(ERROR, f"unknown store op {op}".encode())
        except (StoreError, ValueError, struct.error) as e:
            return self._reply(ERROR, str(e).encode()[:1024])

    @staticmethod
    def _reply(status: int, value: bytes = b"") -> bytes:
        return REP.pack(status, len(value)) + value

    def close(self) -> None:
        self._server.close()


class RemoteStore(dist.Store):
    """The consumer's side: every op is a request on one authenticated connection."""

    def __init__(self, host: str, port: int, token: str | None, timeout_s: float):
        super().__init__()
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s + 5)
            client_hello(self._sock, MAGIC, token)
            (status,) = STATUS.unpack(recv_exact(self._sock, STATUS.size))
        except (OSError, ConnectionError) as e:
            raise TransportError(f"gloo store {host_port(host, port)}: handshake failed: {e}") from e
        if status != OK:
            self._sock.close()
            raise TransportError(f"gloo store {host_port(host, port)} refused the connection: bad token")

    def _call(self, op: int, key: str, value: bytes = b"") -> bytes:
        k = key.encode()
        with self._lock:
            self._sock.sendall(REQ.pack(op, len(k), len(value)) + k + value)
            status, n = REP.unpack(recv_exact(self._sock, REP.size))
            out = recv_exact(self._sock, n)
        if status == TIMEOUT:
            raise TimeoutError(f"gloo store: key(s) {key!r} did not appear in time")
        if status != OK:
            raise RuntimeError(f"gloo store: {out.decode(errors='replace')}")
        return out

    def set(self, key, value):
        self._call(SET, key, _value(value))

    def get(self, key):
        return self._call(GET, key)

    def add(self, key, n):
        return struct.unpack("<q", self._call(ADD, key, struct.pack("<q", n)))[0]

    def wait(self, keys, timeout=None):
        self._call(WAIT, "\0".join(keys))

    def check(self, keys):
        return bool(self._call(CHECK, "\0".join(keys))[0])

    def delete_key(self, key):
        return bool(self._call(DELETE, key)[0])

    def close(self) -> None:
        self._sock.close()
