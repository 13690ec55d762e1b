"""Issue 16 pieces without models: the temp-dir sweep of dead launchers, the process-tree sweep."""

import os
import subprocess
import sys
import threading

import pytest

from omni.fsutil import OWNER_FILE, sweep_stale_tmp


def test_temp_dirs_of_dead_launchers_are_swept_and_no_others(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    dead, live, foreign, garbled = (tmp_path / f"omni-{n}" for n in ("dead", "live", "foreign", "garbled"))
    for d in (dead, live, foreign, garbled):
        d.mkdir()
        (d / "config.json").write_text("{}")
    (dead / OWNER_FILE).write_text(str(dead_pid))
    (live / OWNER_FILE).write_text(str(os.getpid()))
    (garbled / OWNER_FILE).write_text("not a pid")
    assert sweep_stale_tmp(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and foreign.exists() and garbled.exists()


OWNER = r"""
import json, subprocess, sys
from omni import proctree
assert proctree.become_subreaper()
# A child that starts a grandchild and exits at once: the orphan comes back to us, not to PID 1.
mid = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(p.pid)"],
    stdout=subprocess.PIPE, text=True)
orphan = int(mid.stdout.readline())
mid.wait()
import psutil
parent = psutil.Process(orphan).ppid()
killed = [p.pid for p in proctree.kill_descendants()]
import os
print(json.dumps({"orphan": orphan, "parent": parent, "owner": os.getpid(), "killed": killed, "left": psutil.pid_exists(orphan)}))
"""


def test_an_owner_gets_its_orphans_back_and_sweeps_them():
    import json

    r = subprocess.run([sys.executable, "-c", OWNER], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["parent"] == out["owner"]           # reparented to the subreaper, not PID 1
    assert out["killed"] == [out["orphan"]] and not out["left"], out


def _child(code: str):
    from omni.launcher import Child

    c = Child("stage0", "stage", [sys.executable, "-c", code])
    c.start()
    c.proc.wait(30)
    for t in threading.enumerate():   # its log pump reads to EOF, then ends
        if t.name == "omni-log-stage0":
            t.join(10)
    return c


def test_the_cause_quoted_for_a_dead_child_is_its_own():
    code = ("import sys\nfor l in ['omni: stage 0: loading', 'omni: stage 0: failed: ValueError: bad weights',"
            " '(EngineCore pid=7) ERROR Traceback (most recent call last):', '(Worker pid=8) RuntimeError: x']:\n"
            "    print(l, file=sys.stderr, flush=True)\nsys.exit(1)")
    c = _child(code)
    assert c.exit_cause() == "exited with code 1: omni: stage 0: failed: ValueError: bad weights"
    killed = _child("import os, signal, sys; print('omni: stage 0: ready', file=sys.stderr, flush=True); "
                    "os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.exit_cause() == "was killed by SIGKILL"   # not its stale "ready" line


class _BrokenStderr:
    """A launcher stderr whose reader is gone (`omni serve 2>&1 | head` after head exits)."""

    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


class _Stderr:
    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass


# Over 128 KiB of log, twice what a pipe holds: it ends only while someone drains the pipe.
LOUD = "import sys\n{first}for i in range(3000): sys.stderr.write('x' * 60 + '\\n')\nsys.stderr.flush()\n"


@pytest.mark.parametrize("stderr, first", [
    (_BrokenStderr, ""),
    (_Stderr, "sys.stderr.buffer.write(b'\\xff\\n'); sys.stderr.flush()\n"),
], ids=["broken-stderr", "non-utf8"])
def test_a_child_log_is_drained_to_its_end_whatever_befalls_the_launcher_stderr(monkeypatch, stderr, first):
    from omni import launcher

    out = stderr()
    monkeypatch.setattr(sys, "stderr", out)
    c = launcher.Child("loud", "stage", [sys.executable, "-c", LOUD.format(first=first)])
    c.start()
    try:
        assert c.proc.wait(20) == 0
    finally:
        c.proc.kill()
        c.proc.wait()
    launcher.progress("shutting down")   # a broken stderr is no error here either
    if isinstance(out, _Stderr):
        for t in threading.enumerate():
            if t.name == "omni-log-loud":
                t.join(10)
        assert "\ufffd" in "".join(out.parts)


def test_the_sweep_of_a_dead_stage_removes_its_temp_folders_and_no_others(monkeypatch, tmp_path):
    """A SIGKILLed vLLM stage's own folder (vLLM's ipc sockets, its Workers' FileStore file) went only with
    the next launcher's start; its launcher's sweep of the dead stage removes it (another's stays)."""
    import tempfile

    from omni.fsutil import owned_tmp_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    others = owned_tmp_dir()                                     # this process's: alive
    code = ("import os, signal, sys; from omni.fsutil import owned_tmp_dir; d = owned_tmp_dir(); "
            "open(os.path.join(d, 'vllm_dist_x'), 'w').close(); print(d, file=sys.stderr, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    c = _child(code)
    made = c.tail[-1]
    assert os.path.dirname(made) == str(tmp_path) and os.path.isdir(made)
    c.sweep()
    assert not os.path.exists(made)
    assert os.path.isdir(others)
