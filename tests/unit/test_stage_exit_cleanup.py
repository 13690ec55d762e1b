"""A stage that stops or fails while its vLLM engine loads removes vLLM's ipc folder (VLLM_RPC_BASE_PATH) on
its way out: only the engine's shutdown removed it, which never runs then, and Ctrl-C during a load left
/tmp/omni-XXXX with three sockets and an owner file (a headless stage's host never sweeps it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

from omni import fsutil
from tests.e2e.harness import REPO


@pytest.fixture
def short_tmp(monkeypatch):
    """A temp dir short enough for vLLM's socket paths, prepare_env's env put back after the test, and a
    registry of the test's own (another test's engine may live on in this process)."""
    path = tempfile.mkdtemp(prefix="t", dir="/tmp")
    monkeypatch.setattr(fsutil, "_REMOVE_ON_EXIT", set())
    monkeypatch.setattr(tempfile, "tempdir", path)
    for k in ("VLLM_RPC_BASE_PATH", "VLLM_HOST_IP", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_prepare_env_registers_the_ipc_folder_for_the_stages_exit(short_tmp):
    from omni.engines.vllm.args import prepare_env

    made = prepare_env(None, cpu=False)
    assert made and os.path.isdir(made)
    assert fsutil.remove_registered() == [made] and not os.path.exists(made)
    assert fsutil.remove_registered() == []


def test_a_shut_down_engine_leaves_nothing_registered(short_tmp):
    """The engine removed its folder: the exit has nothing left to remove (a later engine's is its own)."""
    import types

    pytest.importorskip("vllm")
    from omni.engines.vllm.args import prepare_env
    from omni.engines.vllm.engine import VllmEngine

    made = prepare_env(None, cpu=False)
    engine = types.SimpleNamespace(label="s", _rpc_dir=made, _hidden=None,
                                   _client=types.SimpleNamespace(shutdown=lambda timeout: None),
                                   _waiter=types.SimpleNamespace(close=lambda: None),
                                   _core_steps=types.SimpleNamespace(close=lambda: None))
    VllmEngine.shutdown(engine)
    assert not os.path.exists(made) and fsutil.remove_registered() == []


def test_the_stop_watcher_removes_the_ipc_folder_before_it_exits(short_tmp, monkeypatch):
    from omni import proctree
    from omni.engines.vllm.args import prepare_env
    from omni.signals import StopRequest
    from omni.stage import main as stage_main

    made = prepare_env(None, cpu=False)
    exited = threading.Event()
    left: list[bool] = []

    def fake_exit(code):
        left.append(os.path.exists(made))
        loaded.set()   # ends the watcher's loop
        exited.set()

    monkeypatch.setattr(proctree, "kill_descendants", lambda **kw: [])
    monkeypatch.setattr(stage_main, "progress", lambda msg: None)
    monkeypatch.setattr(os, "_exit", fake_exit)
    stop = StopRequest()
    loaded, _ = stage_main._stop_while_loading(stop, "stage 0")
    stop.set()
    assert exited.wait(10)
    assert left == [False]


# run_stage with an engine load that makes vLLM's ipc folder, then fails or waits to be stopped.
STAGE = """
import json, os, sys, time
from omni import config as cfg
from omni.engines import factory
from omni.engines.vllm.args import prepare_env
from omni.errors import OmniError
from omni.stage import main as stage_main

def build_engine(config, stage):
    print(json.dumps({"rpc_dir": prepare_env(None, cpu=True)}), flush=True)
    if sys.argv[1] == "fail":
        raise OmniError("the load failed")
    time.sleep(60)

factory.build_engine = build_engine
config = cfg.load("HuggingFaceTB/SmolLM2-135M-Instruct")
rc = stage_main.run_stage(config, 0, stage_main.StageOptions(master_address="127.0.0.1:9"))
print(json.dumps({"rc": rc}), flush=True)
"""


def start(tmp_path, how: str) -> subprocess.Popen:
    (tmp_path / "stage.py").write_text(STAGE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": "/tmp"}
    env.pop("VLLM_RPC_BASE_PATH", None)
    return subprocess.Popen([sys.executable, str(tmp_path / "stage.py"), how], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_stage_whose_vllm_load_fails_removes_the_ipc_folder(tmp_path):
    p = start(tmp_path, "fail")
    out, err = p.communicate(timeout=90)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert lines[-1] == {"rc": 1} and "the load failed" in err, err
    assert lines[0]["rpc_dir"] and not os.path.exists(lines[0]["rpc_dir"])


def test_a_stage_stopped_while_its_vllm_engine_loads_removes_the_ipc_folder(tmp_path):
    p = start(tmp_path, "wait")
    try:
        line = p.stdout.readline()
        rpc_dir = json.loads(line)["rpc_dir"]
        assert rpc_dir and os.path.isdir(rpc_dir)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and "stopped while loading the engine" in err, err
    assert not os.path.exists(rpc_dir)
