"""Run files: `omni serve` notes where its master listens, so a bare `omni status` on the same
host finds it (the master port is random in single-command mode). One JSON file per launcher
process in a per-user folder; removed on exit, and ignored (and cleaned up) once its process is gone.

The folder is used only if it is this user's own (not a link, owned by us, no access for others):
/tmp/omni-UID can be made first by anyone, and a file planted there would send `omni status`, and
its token, to the planter's master."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path

from omni import envs
from omni.deathsig import pid_exists

logger = logging.getLogger(__name__)


def run_dir() -> Path:
    base = envs.OMNI_RUN_DIR
    if base:
        return Path(base)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "omni" if runtime else Path(f"/tmp/omni-{os.getuid()}")


def untrusted(folder: Path) -> str | None:
    """Why `folder` must not be used (None: it is ours alone). Raises FileNotFoundError if it is missing."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory (a symlink?)"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):o}: other users may use it (chmod 700 it)"
    return None


def write(master_address: str, model: str, http: str | None, tls: dict | None = None) -> Path | None:
    """The run file's path; None (with a warning) where the folder is not ours alone: `omni serve`
    runs on, and a bare `omni status` then needs --master. `tls`: the paths (never the content) of the
    files this host's processes connect to a TLS master with, so `omni status` connects as they do."""
    folder = run_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = untrusted(folder)
    except OSError as e:
        why = f"cannot be made: {e}"
    if why is not None:
        logger.warning("no run file for `omni status` (use --master %s): run folder %s %s",
                       master_address, folder, why)
        return None
    path = folder / f"{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)   # a leftover of a dead process with our pid (a link is removed, not followed)
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"pid": os.getpid(), "master": master_address, "model": model,
                            "http": http, "started": time.time(), **({"tls": tls} if tls is not None else {})}))
    tmp.replace(path)
    return path


def remove(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def live_runs() -> list[dict]:
    """Deployments started on this host that still run, newest first; none from a folder not ours alone."""
    folder = run_dir()
    try:
        why = untrusted(folder)
    except OSError:
        return []     # no `omni serve` has written one
    if why is not None:
        logger.warning("ignoring run folder %s: it %s", folder, why)
        return []
    runs = []
    for path in folder.glob("*.json"):
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
