"""Session hygiene: omni processes that outlive the test session are orphans (a bug in shutdown
or in a test's finalizer). They are listed loudly and killed, so one run never loads the next.
Also the `device` fixture of the engine tests: cpu, cuda where a GPU is present, and "fake-cuda" (the
CUDA device emulated on the CPU by tests/unit/fake_cuda.py, so the CUDA paths run on every machine)."""

from __future__ import annotations

import os
import uuid

import pytest

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


def _real_cuda() -> bool:
    from tests.unit.fake_cuda import real_cuda

    return real_cuda()


def pytest_runtest_setup(item):
    """`cuda` tests need a CUDA GPU; here they skip (the engine tests run on both when one is present)."""
    if item.get_closest_marker("cuda") is not None and not _real_cuda():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda), "fake-cuda"])
def device(request):
    """An engine test's device: "cpu", "cuda", then "cuda" emulated on the CPU. On CUDA, float32 stays
    float32 (no TF32 in matmuls or cuDNN convolutions), so a streamed and a whole decode on the device
    compare as on the CPU. The emulator is active for the tests of that parameter (module scope: the
    engines built on it hold its tensors)."""
    if request.param == "fake-cuda":
        from tests.unit.fake_cuda import emulated_cuda

        if _real_cuda():
            pytest.skip("a GPU is here: the cuda parameter runs the real device")
        with emulated_cuda(request.config):
            yield "cuda"
        return
    if request.param != "cuda":
        yield request.param
        return
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield request.param
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module", params=[pytest.param("cuda", marks=pytest.mark.cuda), "fake-cuda"])
def gpu(request):
    """A test of a CUDA-only path: the real GPU where one is present, else the emulated one."""
    if request.param == "cuda":
        yield "cuda"
        return
    from tests.unit.fake_cuda import emulated_cuda

    if _real_cuda():
        pytest.skip("a GPU is here: the cuda parameter runs the real device")
    with emulated_cuda(request.config):
        yield "cuda"


def _graphed_param():
    from tests.unit.fake_cuda import cuda_path

    return cuda_path("graphed")


@pytest.fixture(scope="module", params=["static", "eager", _graphed_param()])
def talker_path(request):
    """The talker tests' decode path: static, eager, or static with CUDA graphs (on the GPU where one is
    present, else on the emulated device; float32 either way, tests/unit/qwen3_ref.py `path_args`)."""
    if request.param == "graphed-cuda":
        yield "graphed"
    elif request.param == "graphed-fake-cuda":
        from tests.unit.fake_cuda import emulated_cuda

        with emulated_cuda(request.config):
            yield "graphed"
    else:
        yield request.param
