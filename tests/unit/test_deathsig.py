"""omni/deathsig.py: a spawn child's death signal from its interpreter's start (the .pth hook),
with real interpreters and real multiprocessing spawns; no model."""

from __future__ import annotations

import json
import os
import selectors
import shlex
import signal
import site
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from omni.deathsig import PARENT_ENV
from omni.engines.torchvision_cpu import PTH_NAME
from tests.e2e.harness import wait_gone

ROOT = Path(__file__).resolve().parents[2]
needs_hook = pytest.mark.skipif(not any((Path(d) / PTH_NAME).exists() for d in site.getsitepackages()),
                                reason="the venv has no omni .pth hook: run `make`")

# What the hook decides, printed by an interpreter that looks like a spawn child (or like the
# resource tracker): its death signal (PR_GET_PDEATHSIG) and whether the variable is left to its children.
REPORT = ("import ctypes, json, os; s = ctypes.c_int(0); "
          "ctypes.CDLL('libc.so.6').prctl(2, ctypes.byref(s), 0, 0, 0); "
          f"print(json.dumps({{'sig': s.value, 'env': os.environ.get('{PARENT_ENV}')}}))")
SPAWN_LIKE = [sys.executable, "-c", f"from multiprocessing.spawn import spawn_main; {REPORT}", "--multiprocessing-fork"]
TRACKER_LIKE = [sys.executable, "-c", f"from multiprocessing.resource_tracker import main; {REPORT}"]


def env(parent: int | None) -> dict:
    e = {**os.environ, "PYTHONPATH": str(ROOT)}
    e.pop(PARENT_ENV, None)
    if parent is not None:
        e[PARENT_ENV] = str(parent)
    return e


def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def run(argv: list[str], parent: int | None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env(parent), capture_output=True, text=True, timeout=60)


@needs_hook
def test_a_spawn_child_of_a_live_parent_gets_sigkill_and_keeps_the_variable_from_its_children():
    r = run(SPAWN_LIKE, os.getpid())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"sig": signal.SIGKILL, "env": None}


@needs_hook
def test_a_spawn_child_whose_parent_is_gone_exits_before_running_anything():
    r = run(SPAWN_LIKE, dead_pid())
    assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)


def test_pid_exists_says_a_zombie_no_longer_runs():
    from omni.deathsig import pid_exists

    z = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, z.pid, os.WEXITED | os.WNOWAIT)   # until it has exited; reaps nothing
        assert psutil.Process(z.pid).status() == psutil.STATUS_ZOMBIE
        assert not pid_exists(z.pid)
        assert pid_exists(os.getpid())
    finally:
        z.wait(10)
    assert not pid_exists(z.pid)


@needs_hook
def test_a_spawn_child_whose_parent_is_an_unreaped_zombie_exits_before_running_anything():
    # CI's container left a dead EngineCore a zombie: the Worker it had spawned lived on.
    z = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, z.pid, os.WEXITED | os.WNOWAIT)   # exited, not reaped
        r = run(SPAWN_LIKE, z.pid)
        assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    finally:
        z.wait(10)


@needs_hook
def test_a_wrapper_between_a_child_and_a_live_parent_is_no_reason_to_exit():
    # `sh -c 'A; B'` stays the child's parent (it cannot exec A): the parent differs, the expected one lives.
    cmd = shlex.join(SPAWN_LIKE) + "; true"
    r = run(["sh", "-c", cmd], os.getpid())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"sig": signal.SIGKILL, "env": None}


@needs_hook
def test_the_resource_tracker_and_plain_interpreters_get_no_death_signal():
    for argv in (TRACKER_LIKE, [sys.executable, "-c", REPORT]):
        r = run(argv, dead_pid())   # even with the parent gone: the tracker cleans up after it
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == {"sig": 0, "env": None}


def test_without_the_variable_nothing_changes():
    r = run(SPAWN_LIKE, None)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"sig": 0, "env": None}


# A parent that spawns a child (multiprocessing 'spawn') under children_die_with_us, with shared
# memory registered with its resource tracker (started in that window too), and prints both pids
# and the segment's name. The child never leaves its bootstrap: unpickling its target imports
# tests/unit/deathsig_child.py, which prints `bootstrap` and blocks there. The test SIGKILLs the parent.
PARENT = r"""
import json, multiprocessing, sys
from multiprocessing import resource_tracker, shared_memory
from omni.deathsig import children_die_with_us
from tests.unit import deathsig_child

ctx = multiprocessing.get_context("spawn")
with children_die_with_us():
    shm = shared_memory.SharedMemory(create=True, size=4096)   # starts the resource tracker
    p = ctx.Process(target=deathsig_child.never_runs)
    p.start()
print(json.dumps({"child": p.pid, "tracker": resource_tracker._resource_tracker._pid, "shm": shm.name}), flush=True)
sys.stdin.read()   # until the test kills us
"""


def readline(proc: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no line within {timeout} s")
    return proc.stdout.readline()


@needs_hook
def test_a_child_in_bootstrap_dies_with_its_sigkilled_parent_and_the_tracker_still_cleans_up():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env(None), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(readline(parent, 60))
        child = psutil.Process(info["child"])
        tracker = psutil.Process(info["tracker"])
        assert readline(parent, 60) == "bootstrap\n"   # the child's: it shares the parent's stdout
        assert "--multiprocessing-fork" in child.cmdline()
        parent.kill()
        parent.wait(10)
        assert not wait_gone([child], 10), "the child outlived its SIGKILLed parent"
        assert not wait_gone([tracker], 30)   # its pipe closed with the child: it unlinks what the parent left, then exits
        assert not Path("/dev/shm", info["shm"]).exists()
    finally:
        parent.kill()
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == parent.pid:
                    p.kill()
            except (OSError, psutil.Error):
                pass
