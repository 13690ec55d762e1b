"""A stage's control surface: engine utility calls (from frontends) and master commands (SLEEP,
WAKE_UP, DRAIN, UNDRAIN, SHUTDOWN), run on the worker's loop thread so the engine has one owner."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from omni.engines.base import EngineError


@dataclass
class Command:
    kind: str
    args: dict
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = True
    message: str = ""


class StageControl:
    def __init__(self, worker: Any):
        self.worker = worker
        # deque: append and popleft are atomic, and the loop's check for nothing queued is one test
        self._commands: deque[Command] = deque()

    def submit(self, kind: str, args: dict | None, timeout: float) -> tuple[bool, str]:
        """Queue a master command for the loop thread and wait for its result."""
        cmd = Command(kind.upper(), args or {})
        self._commands.append(cmd)
        self.worker._wake()
        if not cmd.done.wait(timeout):
            return False, f"{kind} did not finish within {timeout:.0f} s"
        return cmd.ok, cmd.message

    def call(self, method: str, args: dict) -> Any:
        engine = self.worker.engine
        if method == "sleep":
            mode = args.get("mode", "refuse")
            if mode not in ("refuse", "abort"):
                raise EngineError(f"sleep mode {mode!r} is not one of refuse, abort")
            level = int(args.get("level", 1))
            if mode == "abort" and engine.can_sleep_at(level) and not engine.is_sleeping():
                self._abort_all()   # not for an engine that would then refuse to sleep anyway
            if self.worker._reads:   # taken by the engine when their read ends: open work, as its own are
                raise EngineError("cannot sleep with request(s) waiting for their input tensors' read")
            engine.sleep(level)
            return {"is_sleeping": engine.is_sleeping()}
        if method == "wake_up":
            engine.wake_up()
            return {"is_sleeping": engine.is_sleeping()}
        if method == "is_sleeping":
            return engine.is_sleeping()
        if method == "stats":
            return {**engine.stats(), **self.worker.load()["extra"]}
        if method == "ping":
            return "pong"
        raise EngineError(f"unknown utility method {method!r}")

    def _abort_all(self) -> None:
        """vLLM's mode=abort: every request here ends with a 503 that says why, then the engine sleeps."""
        w = self.worker
        w.fail_all(w._reads.drop_all(), f"{w.stage.label} (replica {w.replica_id}) was put to sleep with mode=abort, "
                   "which ended the requests in flight", abort=True)

    @property
    def pending(self) -> bool:
        return bool(self._commands)

    def run_pending(self) -> None:
        """Run queued commands (loop thread only)."""
        w = self.worker
        while self._commands:
            cmd = self._commands.popleft()
            try:
                if cmd.kind == "SLEEP":
                    self.call("sleep", cmd.args)
                    cmd.message = "sleeping"
                elif cmd.kind == "WAKE_UP":
                    self.call("wake_up", cmd.args)
                    cmd.message = "awake"
                elif cmd.kind in ("DRAIN", "UNDRAIN"):
                    w.draining = cmd.kind == "DRAIN"
                    cmd.message = "draining" if w.draining else "serving"
                elif cmd.kind == "SHUTDOWN":
                    w._stopping.set()
                    cmd.message = "shutting down"
                else:
                    raise EngineError(f"unknown command {cmd.kind}")
            except Exception as e:
                cmd.ok, cmd.message = False, f"{w.stage.label}: {e}"
            w.load_snapshot.take()   # before the ack: the heartbeat carrying it says draining / asleep as it now is
            cmd.done.set()
