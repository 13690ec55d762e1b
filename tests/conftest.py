"""Session hygiene: omni processes that outlive the test session are orphans (a bug in shutdown
or in a test's finalizer). They are listed loudly and killed, so one run never loads the next."""

from __future__ import annotations

import os
import uuid

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
