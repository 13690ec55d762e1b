"""The entry functions of vLLM's EngineCore and Worker processes when omni starts them.

They ask the kernel for SIGKILL when their parent dies (a SIGKILLed stage left its EngineCore
and Worker running under PID 1), and register omni's model classes with vLLM's registry in
that process (a spawned interpreter starts with vLLM's own registry). Where the venv has omni's
interpreter-start hook, the EngineCore and Worker ask for it already when their interpreter
starts, before these entries run (omni/deathsig.py). Once vLLM's own teardown is done they exit
at once (exit_after_clean_end), and the EngineCore puts its Workers' FileStore file in the
stage's own folder (file_store_in_stage_folder). On CPU both make vLLM's sampling do what it does
on a GPU (cpu_sampling.py: two rejection-sampler kernels, a seeded generator's rewind).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid

from omni.deathsig import PARENT_ENV, children_die_with_us
from omni.engines.vllm import cpu_sampling
from omni.engines.vllm.core_steps import count_core_steps

# Architectures whose vLLM class omni replaces with a subclass (omni/engines/vllm/models.py).
MODEL_OVERRIDES = {
    # vLLM's Qwen2.5-Omni thinker without the EAGLE-3 interface cannot hand out hidden states.
    "Qwen2_5OmniForConditionalGeneration": "omni.engines.vllm.models:Qwen25OmniThinker",
}


def register_models() -> None:
    """Lazy (by name): nothing is imported until vLLM builds or inspects that architecture."""
    from vllm import ModelRegistry

    for arch, cls in MODEL_OVERRIDES.items():
        ModelRegistry.register_model(arch, cls)


@contextlib.contextmanager
def engine_core_dies_with_us():
    """vLLM starts its EngineCore with EngineCoreProc.run_engine_core as the spawn target; while
    this is active that target is ours."""
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc.__dict__["run_engine_core"]
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core_guarded)
    try:
        with children_die_with_us():   # vLLM starts the EngineCore from this (the main) thread
            yield
    finally:
        EngineCoreProc.run_engine_core = original


def _die_with_parent() -> None:
    import multiprocessing

    from omni.proctree import die_with_parent

    os.environ.pop(PARENT_ENV, None)   # a forked child inherits it; only its own spawns get it again
    parent = multiprocessing.parent_process()
    die_with_parent(signal.SIGKILL, parent.pid if parent is not None else None)


def run_engine_core_guarded(*args, **kwargs):
    """The EngineCore process's entry (a fresh interpreter: spawn). Its Workers get the same
    guard (vLLM's own death pipe lets a Worker linger for seconds after its EngineCore)."""
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    _die_with_parent()
    register_models()
    cpu_sampling.install()   # a uniproc executor samples in this process
    count_core_steps()
    file_store_in_stage_folder()
    WorkerProc.worker_main = staticmethod(run_worker_guarded)   # this process starts them
    make_worker = WorkerProc.make_worker_process

    def make_worker_dying_with_us(*a, **kw):
        with children_die_with_us():   # vLLM's executor starts Workers from the main thread
            return make_worker(*a, **kw)
    WorkerProc.make_worker_process = staticmethod(make_worker_dying_with_us)
    exit_after_clean_end(EngineCoreProc.run_engine_core, *args, **kwargs)


def run_worker_guarded(*args, **kwargs):
    from vllm.v1.executor.multiproc_executor import WorkerProc

    _die_with_parent()
    register_models()
    cpu_sampling.install()
    exit_after_clean_end(WorkerProc.worker_main, *args, **kwargs)


def exit_after_clean_end(entry, *args, **kwargs) -> None:
    """Run vLLM's process entry; when it ends cleanly (returns, or SystemExit 0 / None), exit as a forked
    child does: atexit handlers (logging's flush, multiprocessing's finalizers), then os._exit(0), without
    the interpreter's finalization. In a spawned EngineCore or Worker that finalization (a full GC and module
    teardown over the model's heap) took 1-2 s of CPU after vLLM's teardown, so on a busy CPU host the pair
    ran past the stage's 3 s shutdown grace and vLLM SIGKILLed both. A failure ends as before."""
    try:
        entry(*args, **kwargs)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def file_store_in_stage_folder() -> None:
    """vLLM's Workers meet through a torch FileStore file, TMPDIR/vllm_dist_<hex>, that only their clean
    teardown removes: each stage killed (or stopped mid-load) left one. Where the stage made its own vLLM
    folder (args.prepare_env: VLLM_RPC_BASE_PATH, its owner file naming the stage), the file goes there,
    which the stage's exit, its engine's shutdown and the launcher's sweep remove. Runs in the EngineCore,
    which names the file."""
    import multiprocessing

    from omni.fsutil import owner_of

    folder = os.environ.get("VLLM_RPC_BASE_PATH")
    parent = multiprocessing.parent_process()
    if not folder or parent is None or owner_of(folder) != parent.pid:
        return   # a folder the user chose: vLLM's default place
    from vllm.v1.executor import multiproc_executor, uniproc_executor

    def init_method() -> str:
        return f"file://{folder}/vllm_dist_{uuid.uuid4().hex}"
    for module in (multiproc_executor, uniproc_executor):
        if hasattr(module, "get_file_store_init_method"):
            module.get_file_store_init_method = init_method


def describe_exit(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"process {proc.name} (pid {proc.pid}) {how}"
