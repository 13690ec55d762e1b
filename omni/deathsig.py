"""A death signal for spawned children from the first moment of their interpreter.

omni's entry functions in vLLM's EngineCore and Worker (omni/engines/vllm/procs.py) ask for
SIGKILL when their parent dies, but a spawned child runs them only after its interpreter's
bootstrap (imports, unpickling: seconds); a parent SIGKILLed meanwhile left the child running.
So a process about to spawn such a child names itself in OMNI_DIE_WITH_PARENT
(`children_die_with_us`), and the venv's interpreter-start hook (a .pth file, see
omni/engines/torchvision_cpu.py) calls `at_interpreter_start` in every new interpreter: one that
is a multiprocessing spawn child asks for SIGKILL when its parent dies, and exits at once if the
process it was spawned by is already gone. Without the hook (no `make`) the entry functions'
guard still holds, from their start.

Cheap for every other interpreter: one environment lookup, nothing imported.
"""

from __future__ import annotations

import contextlib
import os

PARENT_ENV = "OMNI_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1
SIGKILL = 9
# multiprocessing's spawn command line (`python -c "from multiprocessing.spawn import spawn_main;
# spawn_main(...)" --multiprocessing-fork`); its resource tracker runs another `-c` program and is
# never matched: it must outlive its parent to clean up the parent's shared memory.
SPAWN_PROGRAM = b"from multiprocessing.spawn import spawn_main"


def prctl(option: int, arg: int) -> bool:
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except OSError:   # not Linux/glibc: the other layers still hold
        return False


@contextlib.contextmanager
def children_die_with_us():
    """Spawn children started meanwhile die with this process, also if it dies during their
    bootstrap. The kernel signals when the *thread* that started a child exits: start them from
    a thread that lives as long as the process (the main thread)."""
    old = os.environ.get(PARENT_ENV)
    os.environ[PARENT_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(PARENT_ENV, None)
        else:
            os.environ[PARENT_ENV] = old


def _is_spawn_child() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:   # sys.argv is not set yet while .pth files run
            args = f.read().split(b"\0")
    except OSError:
        return False
    return b"--multiprocessing-fork" in args and any(a.startswith(SPAWN_PROGRAM) for a in args)


def pid_exists(pid: int) -> bool:
    """`pid` names a process that still runs. A zombie does not: its parent has not reaped it
    yet, which under a PID 1 or subreaper that never reaps (some containers) is forever."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]   # the name may hold spaces and ")"
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def at_interpreter_start() -> None:
    """Run by the .pth hook before anything else in the interpreter; never raises."""
    value = os.environ.pop(PARENT_ENV, None)   # read once: this process's own children are not meant
    if not value:
        return
    try:
        expected = int(value)
        if not _is_spawn_child():
            return
        prctl(PR_SET_PDEATHSIG, SIGKILL)
        # The parent may have died before the prctl: then no signal comes. A parent that differs
        # (a wrapper between us) is no reason to exit; only one that no longer runs is (gone, or
        # a zombie nobody reaps: CI's container kept one and this check missed it).
        if os.getppid() != expected and not pid_exists(expected):
            os._exit(1)
    except Exception:   # noqa: BLE001 - a start-up hook must not break the interpreter
        pass
