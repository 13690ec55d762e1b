"""Run files: `omni serve` notes where its master listens, so a bare `omni status` on the same
host finds it (the master port is random in single-command mode). One JSON file per launcher
process in a per-user folder; removed on exit, and ignored (and cleaned up) once its process is gone."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from omni import envs
from omni.deathsig import pid_exists


def run_dir() -> Path:
    base = envs.OMNI_RUN_DIR
    if base:
        return Path(base)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "omni" if runtime else Path(f"/tmp/omni-{os.getuid()}")


def write(master_address: str, model: str, http: str | None) -> Path:
    folder = run_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "master": master_address, "model": model,
                               "http": http, "started": time.time()}))
    tmp.replace(path)
    return path


def remove(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def live_runs() -> list[dict]:
    """Deployments started on this host that still run, newest first."""
    runs = []
    for path in run_dir().glob("*.json"):
        try:
            entry = json.loads(path.read_text())
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid_exists(pid):
            runs.append(entry)
        else:
            path.unlink(missing_ok=True)
    return sorted(runs, key=lambda e: e.get("started", 0), reverse=True)
