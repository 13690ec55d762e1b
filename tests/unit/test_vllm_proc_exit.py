"""How omni's entries of vLLM's EngineCore and Worker end (omni/engines/vllm/procs.py): a clean end exits
without the interpreter's teardown (which ran the pair past the stage's 3 s grace, and vLLM SIGKILLed them),
and the Workers' FileStore file goes in the stage's own folder, not the temp dir it was left in."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import types

import pytest

from tests.e2e.harness import REPO

ENTRY = r"""
import atexit, sys
from omni.engines.vllm.procs import exit_after_clean_end

class Heap:
    def __del__(self):   # runs in the interpreter's teardown, as a model's heap is freed there
        print("torn down", flush=True)

heap = Heap()
atexit.register(lambda: print("atexit ran", flush=True))

def entry():
    print("entry ran", flush=True)
    {end}

exit_after_clean_end(entry)
"""


def _run(end: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENTRY.replace("{end}", end)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("end", ["return None", "raise SystemExit", "raise SystemExit(0)"])
def test_a_clean_end_runs_atexit_and_skips_the_interpreters_teardown(end):
    r = _run(end)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["entry ran", "atexit ran"], r.stdout   # no "torn down": not finalized


@pytest.mark.parametrize("end, code", [("raise SystemExit(3)", 3), ("raise RuntimeError('boom')", 1)])
def test_a_failed_end_exits_as_before(end, code):
    r = _run(end)
    assert r.returncode == code
    assert "torn down" in r.stdout and "atexit ran" in r.stdout
    if code == 1:
        assert "RuntimeError: boom" in r.stderr


@pytest.fixture
def file_store_patch(monkeypatch):
    """vLLM's executors with their FileStore namer put back after the test; the test process as the stage."""
    pytest.importorskip("vllm")
    import multiprocessing

    from vllm.v1.executor import multiproc_executor, uniproc_executor

    for module in (multiproc_executor, uniproc_executor):
        monkeypatch.setattr(module, "get_file_store_init_method", module.get_file_store_init_method)
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: types.SimpleNamespace(pid=os.getpid()))
    return multiproc_executor, uniproc_executor


def test_the_workers_file_store_goes_in_the_stages_own_folder(monkeypatch, file_store_patch):
    from omni.engines.vllm.procs import file_store_in_stage_folder
    from omni.fsutil import owned_tmp_dir

    folder = owned_tmp_dir()   # as prepare_env makes it: its owner file names the stage
    try:
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", folder)
        file_store_in_stage_folder()
        for module in file_store_patch:
            method = module.get_file_store_init_method()
            assert method.startswith(f"file://{folder}/vllm_dist_"), method
    finally:
        import shutil

        shutil.rmtree(folder)


@pytest.mark.parametrize("owner", [None, "other"])
def test_a_folder_not_the_stages_keeps_vllms_place(monkeypatch, tmp_path, file_store_patch, owner):
    """VLLM_RPC_BASE_PATH chosen by the user (no owner file) or another process's: vLLM's default."""
    from omni.engines.vllm.procs import file_store_in_stage_folder
    from omni.fsutil import OWNER_FILE

    if owner:
        (tmp_path / OWNER_FILE).write_text(str(os.getppid()))
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    file_store_in_stage_folder()
    for module in file_store_patch:
        assert module.get_file_store_init_method().startswith(f"file://{tempfile.gettempdir()}/vllm_dist_")
