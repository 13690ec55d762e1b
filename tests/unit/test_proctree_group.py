"""The launcher's sweep of a gone stage's process group (proctree.kill_group) spares multiprocessing's
resource tracker until the others are gone, so it unlinks the shared memory they left: killed with them
(the whole group at once), it left a vLLM stage's ~400 MiB in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from omni import proctree
from omni.proctree import kill_group

# A stage's shape: it made shared memory through the resource tracker, an engine process (here a fork)
# holds the tracker's pipe, and the stage itself is gone (os._exit: no cleanup of its own).
GROUP = r"""
import os, sys, time
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 16)
print(shm.name, flush=True)
if os.fork() == 0:
    time.sleep(600)
os._exit(0)
"""


def test_the_tracker_outlives_the_rest_of_the_group_and_unlinks_what_it_left(monkeypatch):
    # 30 s, not the launcher's 2 (nor this test's old 10): on 2 loaded cores the tracker's wake-up and unlink
    # can take longer, and a tracker killed at the deadline leaves the segment, failing the test.
    monkeypatch.setattr(proctree, "TRACKER_WAIT_S", 30.0)
    p = subprocess.Popen([sys.executable, "-c", GROUP], stdout=subprocess.PIPE, text=True, start_new_session=True)
    name = p.stdout.readline().strip()
    p.wait(30)
    path = f"/dev/shm/{name.lstrip('/')}"
    members = [q for q in psutil.process_iter() if _pgid(q) == p.pid]
    try:
        assert name and os.path.exists(path) and len(members) == 2   # the engine process and the tracker
        assert kill_group(p.pid)     # returns once the tracker is gone (it unlinks, then exits) or killed
        _, alive = psutil.wait_procs(members, timeout=30)
        assert not alive and not os.path.exists(path)
        assert not [q for q in psutil.process_iter() if _pgid(q) == p.pid]
    finally:
        try:
            os.killpg(p.pid, 9)
        except ProcessLookupError:
            pass
        if os.path.exists(path):
            os.unlink(path)


def _pgid(q: psutil.Process) -> int | None:
    try:
        return os.getpgid(q.pid)
    except OSError:
        return None
