"""Per-token timestamps along the serving path, for finding where latency tails come from.

Off unless OMNI_LATENCY_TRACE names a directory: then each process that calls
`enable(role)` appends JSON lines to `<dir>/<role>-<pid>.jsonl`: `mark(point, rid, n)`
events (time.monotonic(), one clock for every process on the host) and every garbage
collection longer than 1 ms. benchmarks/latency_trace_report.py joins them.
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any

from omni import envs

_file: Any = None
_gc_start = 0.0


def enable(role: str) -> bool:
    """Start tracing in this process when OMNI_LATENCY_TRACE is set; True if on."""
    global _file
    where = envs.OMNI_LATENCY_TRACE
    if not where or _file is not None:
        return _file is not None
    os.makedirs(where, exist_ok=True)
    _file = open(os.path.join(where, f"{role}-{os.getpid()}.jsonl"), "a", buffering=1)
    gc.callbacks.append(_on_gc)
    return True


def on() -> bool:
    return _file is not None


def mark(point: str, rid: str = "", n: int = 0, at: float | None = None) -> None:
    """`at`: an earlier time.monotonic() (another process's, e.g. vLLM's EngineCore's) to note too."""
    if _file is not None:
        e = {"t": time.monotonic(), "p": point, "r": rid, "n": n}
        if at is not None:
            e["at"] = at
        _file.write(json.dumps(e) + "\n")


def _on_gc(phase: str, info: dict) -> None:
    global _gc_start
    if phase == "start":
        _gc_start = time.monotonic()
        return
    dt = time.monotonic() - _gc_start
    if dt > 0.001:
        _file.write(json.dumps({"t": _gc_start, "p": "gc", "gen": info.get("generation"),
                                "ms": round(dt * 1000, 2), "collected": info.get("collected")}) + "\n")
