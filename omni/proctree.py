"""Process-tree ownership: nothing a process started outlives it.

Three layers, because no single one covers every way an owner dies:
- a child asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG), also on SIGKILL;
- an owner makes itself the subreaper of its tree (PR_SET_CHILD_SUBREAPER), so grandchildren
  orphaned by a dying child come back to it instead of PID 1, and sweeps its tree before it exits;
- the launcher kills the whole process group of a stage once the stage is gone.
"""

from __future__ import annotations

import logging
import os
import signal

import psutil

from omni.deathsig import PR_SET_PDEATHSIG
from omni.deathsig import prctl as _prctl

logger = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36


def die_with_parent(sig: int, parent_pid: int | None) -> None:
    """Ask for `sig` when the parent dies; exit now if it already did (the race before prctl)."""
    _prctl(PR_SET_PDEATHSIG, int(sig))
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def become_subreaper() -> bool:
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.name()} (pid {p.pid})")
        except psutil.Error:
            out.append(f"pid {p.pid}")
    return ", ".join(out)


def kill_descendants(grace_s: float = 0.0, exclude: tuple[int, ...] = ()) -> list[psutil.Process]:
    """SIGTERM every descendant, SIGKILL what is left after `grace_s`; the ones that had to be
    killed. Children that exit are reaped (we are their parent or their subreaper)."""
    procs = [p for p in descendants() if p.pid not in exclude]
    if not procs:
        return []
    first = signal.SIGTERM if grace_s > 0 else signal.SIGKILL
    for p in procs:
        try:
            p.send_signal(first)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=max(grace_s, 0.05))
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    if alive:
        psutil.wait_procs(alive, timeout=5.0)
    return procs if grace_s <= 0 else alive


TRACKER = "multiprocessing.resource_tracker"
TRACKER_WAIT_S = 2.0


def _group(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                members.append(p)
        except (OSError, psutil.Error):   # gone meanwhile
            pass
    return members


def _is_tracker(p: psutil.Process) -> bool:
    try:
        return TRACKER in " ".join(p.cmdline())
    except psutil.Error:
        return False


def kill_group(pgid: int) -> bool:
    """SIGKILL what is left of a process group whose leader is gone; True if something was.
    multiprocessing's resource tracker goes last: once the others are gone it unlinks the shared memory
    they left (a vLLM stage's EngineCore and Worker: ~400 MiB of /dev/shm) and exits. Killed with them
    (the launcher's sweep, within 0.5 s of a stage's death), it left all of it."""
    members = _group(pgid)
    trackers = [p for p in members if _is_tracker(p)]
    for p in members:
        if p not in trackers:
            try:
                p.kill()
            except psutil.Error:
                pass
    if trackers:
        psutil.wait_procs(trackers, timeout=TRACKER_WAIT_S)
    try:
        os.killpg(pgid, signal.SIGKILL)   # a tracker that did not finish, and any late member
        return True
    except (ProcessLookupError, PermissionError):
        return bool(members)
