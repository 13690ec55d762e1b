"""Session hygiene: omni processes that outlive the test session are orphans (a bug in shutdown
or in a test's finalizer). They are listed loudly and killed, so one run never loads the next.
Also the fixtures of the engine tests' devices: cpu, and cuda where a GPU is present, else "fake-cuda"
(the CUDA device emulated on the CPU by tests/unit/fake_cuda.py, so the CUDA paths run on every machine)."""

from __future__ import annotations

import contextlib
import os
import sys
import uuid

import pytest

from tests.unit.fake_cuda import cuda_path

# Every process this session starts inherits the tag, so the sweep below touches only ours,
# never another test run's (or a deployment's) on the same machine.
SESSION_TAG = f"OMNI_TEST_SESSION={uuid.uuid4().hex}"
os.environ["OMNI_TEST_SESSION"] = SESSION_TAG.split("=", 1)[1]


def _ours(p) -> bool:
    try:
        with open(f"/proc/{p.pid}/environ", "rb") as f:
            return SESSION_TAG.encode() in f.read().split(b"\0")
    except OSError:
        return False


def _omni_orphans() -> list:
    import psutil

    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] != me and p.info["ppid"] == 1 and ("omni" in cmd or "VLLM" in cmd) and _ours(p):
            found.append(p)
    return found


def pytest_sessionfinish(session, exitstatus):
    orphans = _omni_orphans()
    if not orphans:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for p in orphans:
        line = f"orphaned omni process {p.pid}: {' '.join(p.info['cmdline'])[:200]} (killed)"
        if reporter is not None:
            reporter.write_line(f"WARNING: {line}", yellow=True)
        try:
            p.kill()
        except Exception:
            pass



# This process's title as started. omni.cli.main masks a secret on the command line through setproctitle, and a
# test calling it in-process (--api-key K --dry-run) renamed pytest "omni serve ... --api-key ***" for the rest of
# the session, so `pgrep -f "omni serve"` found pytest.
PROCESS_TITLE = open("/proc/self/cmdline", "rb").read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


@pytest.fixture(autouse=True)
def _process_title_restored():
    yield
    setproctitle = sys.modules.get("setproctitle")   # only a test that set the title imported it
    if setproctitle is not None and setproctitle.getproctitle() != PROCESS_TITLE:
        setproctitle.setproctitle(PROCESS_TITLE)


@pytest.fixture(autouse=True)
def _emulator_only_for_its_tests(request):
    """pytest groups a module's tests by the module-scoped `device`, but a test that does not take
    `device` can run inside the fake-cuda group: it gets the real torch."""
    from tests.unit.fake_cuda import EMULATOR

    emulator = request.config.stash.get(EMULATOR, None)
    callspec = getattr(request.node, "callspec", None)
    uses = callspec is not None and any(str(v).endswith("fake-cuda") for v in callspec.params.values())
    if emulator is None or uses:
        yield
        return
    with emulator.paused():
        yield


def pytest_runtest_setup(item):
    """`cuda` tests need a CUDA GPU; here they skip (the engine tests run on both when one is present)."""
    from tests.unit.fake_cuda import real_cuda

    if item.get_closest_marker("cuda") is not None and not real_cuda():
        pytest.skip("needs a CUDA GPU")


@contextlib.contextmanager
def _on_cuda(request):
    """A `cuda_path` parameter's device: the emulator, or the real GPU with float32 kept float32 (no
    TF32 in matmuls or cuDNN convolutions), so results compare with the CPU's as they would there."""
    if request.param.endswith("fake-cuda"):
        from tests.unit.fake_cuda import emulated_cuda

        with emulated_cuda(request.config):
            yield
        return
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module", params=["cpu", cuda_path()])
def device(request):
    """An engine test's device: "cpu", then "cuda" (the GPU where one is present, else the emulator;
    the engines a module builds on it hold its tensors, hence module scope)."""
    if request.param == "cpu":
        yield "cpu"
        return
    with _on_cuda(request):
        yield "cuda"


@pytest.fixture(scope="module", params=[cuda_path()])
def gpu(request):
    """A test of a CUDA-only path: the real GPU where one is present, else the emulated one."""
    with _on_cuda(request):
        yield "cuda"


@pytest.fixture(scope="module", params=["static", "eager", cuda_path("graphed-")])
def talker_path(request):
    """The talker tests' decode path: static, eager, or static with CUDA graphs (on the GPU where one is
    present, else on the emulated device; float32 either way, tests/unit/qwen3_ref.py `path_args`)."""
    if not request.param.startswith("graphed"):
        yield request.param
        return
    with _on_cuda(request):
        yield "graphed"


@pytest.fixture
def anyio_backend():
    """anyio's own fixture runs each async test on every backend installed (trio too, were it installed by
    something); omni's servers and fakes are asyncio's."""
    return "asyncio"
