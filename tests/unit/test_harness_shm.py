"""tests/e2e/harness.py: OmniProcess.kill() SIGKILLs a whole tree, its resource tracker with it;
the /dev/shm segments the tree held and no live process still maps are unlinked, no other."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import uuid

import psutil

from tests.e2e import harness
from tests.e2e.harness import OmniProcess, processes_under, shm_held, unlink_unheld, wait_until
from tests.unit.shm_child import SIZE, hold


def names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"omni-test-harness-{tag}-{i}" for i in range(n)]


def exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_kill_unlinks_the_segments_its_tree_held_and_no_other():
    own, grandchild, shared, other = names(4)
    with open(f"/dev/shm/{other}", "wb") as f:   # nobody maps it: not the tree's, it stays
        f.truncate(SIZE)
    kept = hold(shared)                          # the tree maps it, and so does this live process
    p = OmniProcess("tree", own, grandchild, shared, module="tests.unit.shm_child")
    try:
        p.wait_for(re.compile("^ready$"), 60)
        assert {own, grandchild, shared} <= shm_held([p.proc.pid, *(c.pid for c in processes_under(p.proc.pid))]).keys()
        p.kill()
        assert not exists(own) and not exists(grandchild)   # before the fix both stayed
        assert exists(shared) and exists(other)
    finally:
        if p.proc.poll() is None:   # an assertion failed before the kill: leave no tree behind
            p.kill()
        kept.close()
        for n in (own, grandchild, shared, other):
            if exists(n):
                os.unlink(f"/dev/shm/{n}")


def test_a_reaped_launchers_kill_acts_on_its_recorded_tree_only(monkeypatch):
    """Tests call kill() in a finalizer after the launcher exited and poll() reaped it: its pid, group and
    session number may be another run's launcher's by then. kill() SIGSTOPped and SIGKILLed that group and
    that session's processes (here a stand-in session) and unlinked their segments; now it acts only on the
    processes recorded while the launcher ran: the child left behind goes, with its segment."""
    own, left = names(2)
    p = OmniProcess("tree", own, left, module="tests.unit.shm_child")
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)   # another run's session
    child = None
    try:
        p.wait_for(re.compile("^ready$"), 60)
        (child,) = processes_under(p.proc.pid)       # `hold left`, in its own group as a stage is
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait(10)                              # reaped: the number is free for anyone
        groups = []
        monkeypatch.setattr(harness.os, "killpg", lambda pgid, sig: groups.append((pgid, sig)))
        # the number reused: it leads a live session again
        monkeypatch.setattr(harness, "session_of", lambda sid: [sid, other.pid])
        p.kill()
        assert groups == []                          # no group by number
        assert other.poll() is None and psutil.Process(other.pid).status() != psutil.STATUS_STOPPED
        assert not child.is_running() and not exists(left)
    finally:
        monkeypatch.undo()
        other.kill()
        other.wait(10)
        if p.proc.poll() is None:
            p.kill()
        if child is not None and child.is_running():   # were the kill to have missed it
            child.kill()
        for n in (own, left):
            if exists(n):
                os.unlink(f"/dev/shm/{n}")


def test_a_reaped_launchers_kill_finds_a_child_it_started_after_the_last_record():
    """A child started after the last record (a restarted stage) has no parent left once the launcher is
    reaped: kill() missed it and its segment. Its session is still the launcher's (the number stays in
    use while any member lives), so kill() takes what is left there."""
    own, late = names(2)
    p = OmniProcess("late", own, late, module="tests.unit.shm_child")
    child = None
    try:
        p.wait_for(re.compile("^ready$"), 60)   # the last record: before the child exists
        os.kill(p.proc.pid, signal.SIGUSR1)
        wait_until(lambda: exists(late) and processes_under(p.proc.pid), 60, "the late child")
        (child,) = processes_under(p.proc.pid)
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait(10)
        assert child not in p._tree                 # not recorded: found only through the session
        p.kill()
        assert not child.is_running() and not exists(late)
    finally:
        if child is not None and child.is_running():
            child.kill()
        for n in (own, late):
            if exists(n):
                os.unlink(f"/dev/shm/{n}")


def test_unlink_unheld_leaves_a_mapped_segment_and_a_missing_one_alone():
    mapped, gone = names(2)
    m = hold(mapped)
    try:
        held = shm_held([os.getpid()])
        assert mapped in held
        assert unlink_unheld({**held, gone: 1}) == []
        assert exists(mapped)
    finally:
        m.close()
    assert unlink_unheld({mapped: held[mapped]}) == [mapped]
    assert not exists(mapped)


def test_unlink_unheld_leaves_a_name_that_now_names_another_segment():
    (name,) = names(1)
    m = hold(name)
    held = shm_held([os.getpid()])
    m.close()
    os.unlink(f"/dev/shm/{name}")
    with open(f"/dev/shm/{name}", "wb") as f:   # the name made again: someone else's now
        f.truncate(SIZE)
    try:
        assert unlink_unheld({name: held[name]}) == []
        assert exists(name)
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_a_named_semaphore_is_found_by_its_inode():
    """sem_open maps a temp file sem.XXXXXX, links it as sem.NAME and unlinks the temp: maps shows
    the temp name, deleted (vLLM's multiprocessing locks are such semaphores)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.sem_open.restype = ctypes.c_void_p
    (name,) = names(1)
    sem = libc.sem_open(f"/{name}".encode(), os.O_CREAT | os.O_EXCL, 0o600, 1)
    assert sem not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    try:
        assert f"sem.{name}" in shm_held([os.getpid()])
    finally:
        libc.sem_close(ctypes.c_void_p(sem))
        libc.sem_unlink(f"/{name}".encode())
