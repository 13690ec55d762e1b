"""Consumers let go of producers that are gone.

A consumer keeps what it opened for a producer's next ref: shm maps each segment (a memfd), cuda_ipc
maps each device segment and the producer's fence, tcp and gloo keep idle connections (gloo also its
process groups). A producer that dies or closes is told to nobody, so these stayed for the consumer's
life: a dead shm producer's pages (the memfd lives while a mapping does), a dead cuda_ipc producer's
device memory. At most once a SWEEP_S, on a `get`, each consumer asks whether its producers still
listen (shm, cuda_ipc: a connect to the producer's abstract unix name, closed at once, which the
server drops without a word; refused once its process is gone) or whether an idle connection was
closed by its peer (tcp, gloo: readable while idle), and drops what belongs to the gone ones. A ref
of a gone producer then fails as unreachable, as it would in a consumer that never mapped it."""

from __future__ import annotations

import select
import socket
import time

SWEEP_S = 5.0


class Sweep:
    """`due()` is True at most once every `every_s` (the first call: True)."""

    def __init__(self, every_s: float = SWEEP_S):
        self.every_s = every_s
        self._at = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._at:
            return False
        self._at = now + self.every_s
        return True


def listening(name: str, kind: int) -> bool:
    """Whether something listens at the abstract unix `name` (never blocks: a full backlog is a yes)."""
    with socket.socket(socket.AF_UNIX, kind) as sock:
        sock.setblocking(False)
        try:
            sock.connect("\0" + name)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
    return True


def closed_by_peer(sock: socket.socket) -> bool:
    """An idle connection that is readable: its peer closed it (or sent what nobody asked for)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True
