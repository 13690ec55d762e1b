"""A closed terminal (SIGHUP) stops omni as SIGTERM does: the launcher removes its temp folder (config.json
holds the stages' env) and its run file, `omni master` stops cleanly. SIGHUP's default action ended the
process with no cleanup. A stop during start-up is a clean end (0), as one while serving is. A SIGHUP
ignored at start (`nohup omni ...`) stays ignored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.harness import REPO


def _default_hup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)   # a suite run under nohup must not make every child ignore it


def _start(args: list[str], tmp_path, line: str, preexec_fn=_default_hup) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "OMNI_RUN_DIR": str(tmp_path / "run")}
    (tmp_path / "tmp").mkdir()
    (tmp_path / "run").mkdir(mode=0o700)
    env.pop("OMNI_TOKEN", None)
    p = subprocess.Popen([sys.executable, "-m", "omni.cli", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=preexec_fn)
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        out = p.stdout.readline()
        if not out:
            break
        seen.append(out)
        if line in out:
            return p
    p.kill()
    p.wait(10)
    pytest.fail(f"no {line!r} within 60 s: {''.join(seen)}")


def _stop(p: subprocess.Popen) -> tuple[int, str]:
    p.send_signal(signal.SIGHUP)
    try:
        rc = p.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        raise
    return rc, p.stdout.read()


def test_sighup_stops_the_launcher_and_it_cleans_up(tmp_path):
    # A head of master and frontends only: it waits for stage 0, which never comes (no engine is loaded).
    p = _start(["serve", "smollm2", "--stage-id", "0", "--num-replicas", "0", "--port", "0",
                "--omni-master-address", "127.0.0.1", "--omni-master-port", "0"], tmp_path, "waiting for")
    assert [d for d in os.listdir(tmp_path / "tmp") if d.startswith("omni-")]
    assert os.listdir(tmp_path / "run")
    rc, out = _stop(p)
    assert rc == 0, out
    assert "stopped during start-up" in out
    assert not [d for d in os.listdir(tmp_path / "tmp") if d.startswith("omni-")], out
    assert not os.listdir(tmp_path / "run"), out


def test_sighup_stops_a_standalone_master(tmp_path):
    p = _start(["master", "--host", "127.0.0.1", "--port", "0"], tmp_path, "listening on")
    rc, out = _stop(p)
    assert rc == 0 and "stopping the omni master" in out, out


def test_an_ignored_sighup_is_kept_as_nohup_asks():
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        from omni.signals import StopRequest
        stop = StopRequest().install(signals=(signal.SIGHUP,))
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        stop.close()
    finally:
        signal.signal(signal.SIGHUP, old)


def test_a_master_started_under_nohup_outlives_a_hangup(tmp_path):
    p = _start(["master", "--host", "127.0.0.1", "--port", "0"], tmp_path, "listening on",
               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        p.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert p.poll() is None, p.stdout.read()
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
    assert rc == 0 and "stopping the omni master" in p.stdout.read()
