"""Weights off the device while an engine sleeps: the sleep / wake_up bookkeeping every torch engine
shares (the vocoders, the talkers)."""

from __future__ import annotations

from typing import Callable

import torch

from omni.engines.base import EngineError


class IdleOffload:
    """sleep / wake_up for a torch engine: `off()` moves its weights (and whatever device state it
    holds) to host memory, `on()` brings them back. Refused on CPU (nothing to free) and while work
    is open."""

    def __init__(self, name: str, device: torch.device, off: Callable[[], None], on: Callable[[], None]):
        self.name, self.device = name, device
        self._off, self._on = off, on
        self.sleeping = False

    def can_sleep(self) -> bool:
        return self.device.type != "cpu"

    def sleep(self, open_work: int, what: str = "stream(s) open") -> None:
        if not self.can_sleep():
            raise EngineError(f"{self.name} on CPU cannot sleep: its weights have no device memory to free")
        if open_work:
            raise EngineError(f"{self.name} cannot sleep with {open_work} {what}")
        if self.sleeping:
            return
        self._off()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()       # hand the freed blocks back, or nobody else can use them
        self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self._on()
            self.sleeping = False
