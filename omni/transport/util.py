"""Small helpers shared by the transports: dtype names, ref checks, socket I/O."""

from __future__ import annotations

import math
import select
import socket
import time
from typing import Callable, TypeVar

import torch

from omni.digits import ascii_int
from omni.transport.base import TensorRef, TransportError

T = TypeVar("T")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
        "uint8", "bool", "complex64", "complex128",
    )
}


_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)   # a dict lookup: this runs on every put
    if name is None:
        raise TransportError(f"dtype {dtype} is not supported by omni transports")
    return name


def check_ref(ref: TensorRef, transports: tuple[str, ...]) -> torch.dtype:
    """Validate the parts of a ref every transport relies on; return its torch dtype."""
    if ref.transport not in transports:
        raise TransportError(f"ref for transport {ref.transport!r} given to a {'/'.join(transports)} consumer")
    dtype = _DTYPES.get(ref.dtype)
    if dtype is None:
        raise TransportError(f"ref key {ref.key}: unknown dtype {ref.dtype!r}")
    if any(d < 0 for d in ref.shape):
        raise TransportError(f"ref key {ref.key}: negative dimension in shape {ref.shape}")
    expected = math.prod(ref.shape) * dtype.itemsize
    if ref.nbytes != expected:
        raise TransportError(
            f"ref key {ref.key}: nbytes {ref.nbytes} does not match dtype {ref.dtype} "
            f"and shape {tuple(ref.shape)} ({expected} bytes)"
        )
    return dtype


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D uint8 view of a contiguous CPU tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def as_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (no copy)."""
    return memoryview(flat_bytes(tensor).numpy())


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """Detached, contiguous, with its conjugate and negative bits resolved: what every producer
    copies or keeps. (A lazy `conj()` view's memory holds the unconjugated values: sent as is, the
    consumer got them; a byte view of it raises.) No copy for a plain contiguous tensor."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous()


def prepare(tensor: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """`plain`, on `device`: what a keyed producer (tcp, gloo) keeps."""
    if not isinstance(tensor, torch.Tensor):
        raise TransportError(f"put() needs a torch.Tensor, got {type(tensor).__name__}")
    dtype_name(tensor.dtype)
    return plain(tensor.detach().to(device))


def recv_exact(sock: socket.socket, n: int, spin_s: float = 0.0) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), spin_s)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, spin_s: float = 0.0) -> None:
    """Fill `view` from `sock`. With `spin_s`, read without blocking while bytes keep coming and
    wait (up to the socket's timeout) only after `spin_s` with none: each time a reader sleeps,
    its wake-up from a halted vCPU costs ~30 us, many times per tensor on loopback
    (docs/transport-benchmarks.md, "Wake-ups")."""
    if spin_s > 0:
        timeout = sock.gettimeout()
        sock.setblocking(False)
        try:
            _recv_polling(sock, view, spin_s, timeout)
        finally:
            sock.settimeout(timeout)
        return
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k


def _recv_polling(sock: socket.socket, view: memoryview, spin_s: float, timeout: float | None) -> None:
    got, n = 0, len(view)
    quiet_since = time.perf_counter()
    waiter = None
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except BlockingIOError:
            if time.perf_counter() - quiet_since < spin_s:
                continue
            if waiter is None:
                waiter = select.poll()
                waiter.register(sock, select.POLLIN)
            if not waiter.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError(f"no bytes within {timeout} s ({got} of {n} received)") from None
            quiet_since = time.perf_counter()
            continue
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
        quiet_since = time.perf_counter()


def spin_until(probe: Callable[[], T], seconds: float) -> T:
    """Call `probe` without pause until it returns something truthy or `seconds` pass; its last
    result. The spin before a blocking wait (OMNI_SPIN_US): see docs/transport-benchmarks.md."""
    deadline = time.perf_counter() + seconds
    while True:
        got = probe()
        if got or time.perf_counter() >= deadline:
            return got


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    number = ascii_int(port)
    if not sep or number is None:
        raise TransportError(f"bad endpoint {endpoint!r}, expected host:port")
    return host.strip("[]"), number
