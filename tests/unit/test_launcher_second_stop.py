"""A second stop request (Ctrl-C again) while the launcher stops gracefully ends the grace: every child's
process group is killed at once, instead of waiting out each child's 10 s."""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from omni import config as cfg
from omni.launcher import Child, LaunchPlan, Launcher

# Ignores SIGTERM and SIGINT, as a stage busy in its engine may; so does the grandchild in its group.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN)
g = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("grandchild", g.pid, file=sys.stderr, flush=True)
time.sleep(600)
"""


def _grandchild(child: Child, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(child.tail):
            if line.startswith("grandchild "):
                return int(line.split()[1])
        child.proc.poll()
        time.sleep(0.05)
    pytest.fail("the fake stage did not start its grandchild")


def _gone(pid: int) -> bool:
    """SIGKILL is delivered, not waited for: give the kernel a moment to end it (a zombie counts)."""
    try:
        p = psutil.Process(pid)
        _, alive = psutil.wait_procs([p], timeout=5.0)
        return not alive or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_second_stop_request_kills_the_children_at_once(capsys):
    launcher = Launcher(LaunchPlan(cfg.load("smollm2"), stages=[0], host_master=False, api_server_count=0))
    child = Child("stage0", "stage", [sys.executable, "-c", STUBBORN], stage_id=0)
    launcher.children.append(child)
    child.start()
    grandchild = _grandchild(child)
    launcher._stop.set()   # the first Ctrl-C: the graceful stop
    send = child.proc.send_signal

    def then_ctrl_c_again(sig):
        send(sig)
        launcher._stop.set()
    child.proc.send_signal = then_ctrl_c_again
    t0 = time.monotonic()
    launcher.shutdown(grace_s=8.0)
    assert time.monotonic() - t0 < 5.0
    assert child.proc.returncode == -9
    assert _gone(grandchild)
    assert "second stop request: killing every child now" in capsys.readouterr().err
