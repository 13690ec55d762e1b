"""Session hygiene: omni processes that outlive the test session are orphans (a bug in shutdown
or in a test's finalizer). They are listed loudly and killed, so one run never loads the next.
Also the `device` fixture of the engine tests (cpu, then cuda where a GPU is present)."""

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



def pytest_runtest_setup(item):
    """`cuda` tests need a CUDA GPU; here they skip (the engine tests run on both when one is present)."""
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """An engine test's device, "cpu" then "cuda". On CUDA, float32 stays float32 (no TF32 in matmuls or
    cuDNN convolutions), so a streamed and a whole decode on the device compare as on the CPU."""
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
