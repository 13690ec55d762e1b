"""Start real `omni` processes for e2e tests: read their ports from their output,
wait for readiness against a deadline while checking they are alive, and kill the
whole process group in the finalizer."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"serving .* on http://([\d.]+):(\d+)")
MASTER = re.compile(r"master listening on ([\d.]+):(\d+)")
READY = re.compile(r"registered as replica (\S+),")


def omni_env(**extra: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMNI_TEST": "1", "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


class OmniProcess:
    """One `omni ...` command in its own process group."""

    def __init__(self, *args: str, env: dict | None = None, prefix: tuple[str, ...] = ()):
        # prefix: a command that runs the rest, e.g. ("ip", "netns", "exec", NAME).
        self.argv = [*prefix, sys.executable, "-m", "omni.cli", *args]
        self.proc = subprocess.Popen(
            self.argv, cwd=REPO, env=env or omni_env(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: re.Pattern, timeout: float = 180.0) -> re.Match:
        """The first output line matching pattern; fails at once if the process exits."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = pattern.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                if self.proc.poll() is not None and seen == len(self.lines):
                    raise AssertionError(f"{self.argv} exited with {self.proc.returncode} before "
                                         f"{pattern.pattern!r}:\n" + self.output())
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out waiting for {pattern.pattern!r}:\n" + self.output())
                self._cond.wait(min(remaining, 0.5))

    def output(self) -> str:
        return "\n".join(self.lines[-80:])

    def http(self, timeout: float = 240.0) -> str:
        m = self.wait_for(SERVING, timeout)
        return f"http://{m.group(1)}:{m.group(2)}"

    def master_address(self, timeout: float = 60.0) -> str:
        m = self.wait_for(MASTER, timeout)
        return f"{m.group(1)}:{m.group(2)}"

    def interrupt(self, timeout: float = 60.0) -> int:
        """Ctrl-C as a terminal sends it: SIGINT to the whole process group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def omni_shm_entries() -> list[str]:
    return sorted(p for p in os.listdir("/dev/shm") if "omni" in p)
