"""Replicas of a test's MasterServer: a client that registers and keeps its lease, and a wait with a deadline
for what the master reports."""

from __future__ import annotations

import time
from typing import Callable

from omni.master.client import MasterClient


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition not met") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} before the deadline"
        time.sleep(0.02)


def keep_alive(address: str, role: str, stage_id: int, config_hash: str, answer: Callable = lambda cmd: (True, ""),
               **register) -> MasterClient:
    """A registered client (`register`: MasterClient.register's host, pid, replica_hint...) heartbeating every
    0.1 s; `answer(cmd)` acks each command. The caller closes it."""
    c = MasterClient(address)
    c.register(role, stage_id, config_hash=config_hash, **register)
    c.start_keepalive(lambda: {}, answer, interval_s=0.1)
    return c


def ready(client: MasterClient, want: int) -> None:
    """Wait until `want` replicas are READY."""
    wait_until(lambda: sum(r.state == "READY" for r in client.get_status().replicas) >= want,
               what=f"{want} replica(s) never READY")
