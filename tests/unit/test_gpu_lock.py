"""omni/stage/gpu_lock.py: stages pinned to one GPU load their engines one at a time (vLLM sizes its
KV cache from the GPU's free memory while it profiles), across processes; CPU and unpinned stages
take no lock."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from omni.stage.gpu_lock import one_load_per_gpu, pinned_gpus

HOLDER = """
import sys
from pathlib import Path
from omni.stage.gpu_lock import one_load_per_gpu
with one_load_per_gpu("0", "stage 0 (thinker)", say=print, folder=Path(sys.argv[1])):
    print("holding", flush=True)
    sys.stdin.readline()
print("released", flush=True)
"""


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "locks"
    d.mkdir(mode=0o700)
    return d


def wait_for(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.02)


def test_a_second_process_on_the_gpu_waits_for_the_first_load(folder, monkeypatch):
    """Two stages on GPU 0: the second's load starts only once the first's has ended, and it says whom
    it waits for. The three stages of qwen3-omni-moe-1gpu loaded at once."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "holding"
        notes: list[str] = []
        loading = threading.Event()

        def second() -> None:
            with one_load_per_gpu("0", "stage 1 (talker)", say=notes.append, folder=folder):
                loading.set()
        t = threading.Thread(target=second, daemon=True)
        t.start()
        wait_for(lambda: notes, "waiting note")
        assert not loading.wait(0.5)
        assert notes[0].startswith("stage 1 (talker): waiting for GPU 0 (0 s): stage 0 (thinker) "
                                   f"(pid {holder.pid}) is loading its engine there")
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        assert loading.wait(20)
        t.join(20)
        assert len(notes) == 1
    finally:
        holder.kill()
        holder.wait()


def load_in_thread(devices: str, folder: Path, notes: list[str]) -> bool:
    """A load on another thread (another open of the lock file: flock sees it as another holder)
    got through within 10 s."""
    done = threading.Event()

    def load() -> None:
        with one_load_per_gpu(devices, "b", say=notes.append, folder=folder):
            done.set()
    threading.Thread(target=load, daemon=True).start()
    return done.wait(10)


def test_other_gpus_cpu_and_unpinned_stages_do_not_wait(folder, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    notes: list[str] = []
    with one_load_per_gpu("0", "a", say=notes.append, folder=folder):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        assert load_in_thread("1", folder, notes) and not notes
        for devices in ("cpu", "", " CPU "):
            with one_load_per_gpu(devices, "c", say=notes.append, folder=folder / "none"):
                pass
        assert not notes and not (folder / "none").exists()


def test_pinned_gpus_follow_the_visible_devices(monkeypatch):
    """select_devices maps a stage's indices through an outer selection first: the lock is the GPU's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert pinned_gpus("0,1") == ["1", "3"] and pinned_gpus("cpu") == [] and pinned_gpus("") == []


def test_released_on_failure_and_while_a_forked_child_lives(folder, monkeypatch):
    """A load that raises lets the next one go; so does one whose engine forked a process that still
    holds the lock file's descriptor (vLLM's EngineCore, for as long as it serves)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError, match="no memory"):
        with one_load_per_gpu("0", "a", say=print, folder=folder):
            raise RuntimeError("no memory")
    with one_load_per_gpu("0", "a", say=print, folder=folder):
        fds = [int(p.name) for p in Path("/proc/self/fd").iterdir()
               if os.path.realpath(p) == str(folder / "gpu-0.lock")]
        child = subprocess.Popen(["sleep", "30"], pass_fds=fds)
    try:
        assert fds
        notes: list[str] = []
        assert load_in_thread("0", folder, notes) and not notes
    finally:
        child.kill()
        child.wait()


def test_a_lock_folder_others_can_write_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    notes: list[str] = []
    with one_load_per_gpu("0", "stage 0", say=notes.append, folder=open_folder):
        pass
    assert notes == [f"stage 0: engine loads on GPU 0 are not serialised: lock folder {open_folder} has mode 777: "
                     "other users may use it (chmod 700 it)"]
    assert not list(open_folder.iterdir())


STAGE = """
import fcntl, json, os, sys
from pathlib import Path
from omni.config import loads_json
from omni.engines import factory
from omni.errors import OmniError
from omni.stage import gpus, main as stage_main

seen = {}

def build_engine(config, stage):     # is the stage's GPU held while its engine loads?
    path = Path(os.environ["OMNI_RUN_DIR"]) / "gpu-locks" / "gpu-5.lock"
    if path.exists():
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen["held"] = False
        except BlockingIOError:
            seen["held"] = True
        os.close(fd)
        seen["holder"] = path.read_text()
    raise OmniError("stop here")

factory.build_engine = build_engine
gpus.visible_gpus = lambda: (1, None)   # no GPU here: the stage sees the one it names
rc = stage_main.run_stage(loads_json(open(sys.argv[1]).read()), 1, stage_main.StageOptions(master_address="127.0.0.1:9"))
print(json.dumps({"rc": rc, **seen}), flush=True)
"""


def test_a_stage_holds_its_gpu_while_its_engine_loads(tmp_path, monkeypatch):
    """run_stage builds the engine of a stage pinned to GPU 1 (of an outer CUDA_VISIBLE_DEVICES 4,5:
    GPU 5) holding GPU 5's lock, which is free again once the load has ended (here: failed)."""
    import fcntl
    import json

    from omni import config as cfg
    from tests.e2e.harness import REPO

    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    (tmp_path / "overlay.yaml").write_text("stages:\n  - {stage_id: 1, devices: '1'}\n")
    config = cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct", str(tmp_path / "overlay.yaml"))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "stage.py").write_text(STAGE)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "4,5", "PYTHONPATH": str(REPO), "OMNI_RUN_DIR": str(run)}
    r = subprocess.run([sys.executable, str(tmp_path / "stage.py"), str(tmp_path / "config.json")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["rc"] == 1 and "stop here" in r.stderr
    assert seen.get("held") is True and seen["holder"].startswith("stage 1 ")
    fd = os.open(run / "gpu-locks" / "gpu-5.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
