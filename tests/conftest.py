"""Session hygiene: omni processes that outlive the test session are orphans (a bug in shutdown
or in a test's finalizer). They are listed loudly and killed, so one run never loads the next."""

from __future__ import annotations

import os


def _omni_orphans() -> list:
    import psutil

    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] != me and p.info["ppid"] == 1 and ("omni.children" in cmd or "omni.cli" in cmd):
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
