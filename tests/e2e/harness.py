"""Start real `omni` processes for e2e tests: read their ports from their output,
wait for readiness against a deadline while checking they are alive, and kill the
whole process group in the finalizer."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from pathlib import Path

import httpx

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

    def __init__(self, *args: str, env: dict | None = None, prefix: tuple[str, ...] = (), module: str = "omni.cli"):
        # prefix: a command that runs the rest, e.g. ("ip", "netns", "exec", NAME); module: the
        # entry point (omni.children for a launcher's child alone)
        self.argv = [*prefix, sys.executable, "-m", module, *args]
        self.proc = subprocess.Popen(
            self.argv, cwd=REPO, env=env or omni_env(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
        )
        self.lines: list[str] = []
        self._tree: set = set()      # psutil processes of its tree, recorded while its pid was its own
        self._noted = 0.0
        self._eof = False            # the pump has read all the output
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, pattern: re.Pattern, timeout: float = 180.0) -> re.Match:
        """The first output line matching pattern; fails once the process has exited and its output is read."""
        deadline = time.monotonic() + timeout
        seen = 0
        exited = None
        with self._cond:
            while True:
                self._note_tree(every_s=0.5)
                for line in self.lines[seen:]:
                    m = pattern.search(line)
                    if m:
                        self._note_tree()   # as it was when ready: what kill() acts on once it is reaped
                        return m
                seen = len(self.lines)
                if self.proc.poll() is not None:
                    # its last lines may still be in the pipe: fail once the pump has read them all
                    # (or 2 s on, if a child of it still holds the pipe open)
                    exited = exited or time.monotonic()
                if exited is not None and (self._eof or time.monotonic() - exited > 2.0):
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

    def _note_tree(self, every_s: float = 0.0) -> None:
        """Record the launcher's tree while its pid, group and session number are still its own (it runs,
        or exited unreaped): once reaped, the number may be another run's launcher's."""
        if self.proc.returncode is None and time.monotonic() - self._noted >= every_s:
            self._noted = time.monotonic()
            found = (*processes_under(self.proc.pid), *map(_process, session_of(self.proc.pid)))
            self._tree.update(q for q in found if q is not None and q.pid != self.proc.pid)

    def _known(self) -> list:
        """What was recorded while the launcher ran and, once it is reaped, what is left in its session:
        a child it started after the last record has no parent left to find it by."""
        return [*self._tree, *(left_in_session(self.proc.pid) if self.proc.returncode is not None else ())]

    def _recorded_tree(self) -> list:
        """The recorded processes that still run (psutil tells a reused pid by its start time), with the
        descendants they have now."""
        return _live_with_children(self._known())

    def kill(self) -> None:
        """SIGKILL the launcher's group and every process it started (its children run in their own
        groups: left to their PR_SET_PDEATHSIG, they would finish a graceful stop under the next test),
        then unlink the /dev/shm segments they held that no live process maps any more: the tree's
        resource tracker dies with it, so vLLM's psm_* rings (hundreds of MB each) would stay.
        A launcher already reaped: only what was recorded while it ran, never its pid's number."""
        import psutil

        own = self.proc.returncode is None   # unreaped: its pid, group and session are still its own
        tree = freeze(self.proc.pid) if own else freeze_recorded(self._known())
        try:
            held = shm_held([*([self.proc.pid] if own else []), *(q.pid for q in tree)])
        finally:
            if own:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            for q in tree:
                with contextlib.suppress(psutil.Error):
                    q.kill()
        self.proc.wait(10)
        psutil.wait_procs(tree, timeout=10)
        unlink_unheld(held)

    def stop(self, timeout: float = 60.0) -> list[int]:
        """Stop as a user would (Ctrl-C), then wait until the launcher and every process it had
        started are gone: its children run in their own process groups and, once reparented,
        finish their own graceful stop. Past `timeout`, whatever still runs is SIGKILLed.
        Returns the pids of that tree (for checks on what they left, e.g. in /dev/shm)."""
        import psutil

        self._note_tree()
        tree = self._recorded_tree()
        pids = [self.proc.pid, *(p.pid for p in tree)]
        deadline = time.monotonic() + timeout
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        left = wait_gone(tree, max(0.0, deadline - time.monotonic()))
        if left or self.proc.poll() is None:
            self.kill()   # the launcher's session holds what is left: kill() reaps their shm too
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            left = wait_gone(left, 10)
            assert not left, f"still running 10 s after SIGKILL: {[p.pid for p in left]}"
        return pids


def _process(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _runs(p) -> bool:
    """Still running: a zombie is not (a parent that died leaves one unreaped in some containers),
    and a reused pid is not the same process (psutil compares start times)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(fn, timeout: float, what: str, every_s: float = 0.2):
    """fn()'s first true value, polled every `every_s` s; fails naming `what` past the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        threading.Event().wait(every_s)   # polling another process's state, bounded by the deadline


def wait_gone(procs: list, timeout: float) -> list:
    """The processes of `procs` still running after `timeout` s (polled: they are not our children)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if _runs(p)]
        if not left or time.monotonic() >= deadline:
            return left
        threading.Event().wait(0.1)   # polling other processes, bounded by the deadline


def processes_under(pid: int) -> list:
    """The live descendants of pid (psutil processes)."""
    return [q for q in map(_process, descendants(pid)) if q is not None]


def freeze(pid: int) -> list:
    """SIGSTOP pid's descendants and the rest of its session (a child reparented to PID 1 keeps
    it) until no new one appears, so none maps a segment after shm_held looked; returns them.
    Only for an unreaped child's pid: a reaped one's number may be anyone's."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGSTOP)
    return _suspend_until_no_new(lambda seen: [q for q in (*processes_under(pid), *map(_process, session_of(pid)))
                                              if q is not None and q.pid != pid])


def freeze_recorded(known) -> list:
    """freeze() for a reaped launcher: the psutil processes `known` from while it ran that still run,
    and their descendants, by process (start time checked), never by pid, group or session number."""
    return _suspend_until_no_new(lambda seen: _live_with_children([*known, *seen.values()]))


def _suspend_until_no_new(find) -> list:
    import psutil

    seen: dict[int, object] = {}
    for _ in range(5):
        new = [q for q in find(seen) if q.pid not in seen]
        if not new:
            break
        for q in new:
            seen[q.pid] = q
            with contextlib.suppress(psutil.Error):
                q.suspend()
    return list(seen.values())


def _live_with_children(procs) -> list:
    """Those of `procs` (psutil processes) still running, and their descendants (psutil leaves out a
    child older than its parent: a reused pid's)."""
    import psutil

    out: dict[int, object] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if _runs(p):
                out.setdefault(p.pid, p)
                for c in p.children(recursive=True):
                    out.setdefault(c.pid, c)
    return list(out.values())


def left_in_session(sid: int) -> list:
    """The processes of a reaped leader's session `sid`. Linux keeps a number in use while a session or
    group holds it, so while any is left the number cannot lead another session: they are the old
    leader's. A live process numbered `sid` means ours had emptied and the number was reused: none."""
    pids = session_of(sid)
    return [] if sid in pids else [q for q in map(_process, pids) if q is not None]


def session_of(sid: int) -> list[int]:
    """Pids of session `sid` (its leader included)."""
    out = []
    for pid in _pids():
        with contextlib.suppress(OSError):
            if os.getsid(pid) == sid:
                out.append(pid)
    return out


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def shm_held(pids) -> dict[str, int]:
    """The /dev/shm entries (name: inode) these processes map or hold open. By inode, not by the
    path maps shows: glibc's sem_open maps a temp file it then links as sem.NAME and unlinks, so a
    semaphore's mapping reads /dev/shm/sem.XXXXXX (deleted)."""
    shm = os.stat("/dev/shm").st_dev
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        dev, ino = line.split()[3:5]
                        major, minor = (int(x, 16) for x in dev.split(":"))
                        if os.makedev(major, minor) == shm:
                            inodes.add(int(ino))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    if st.st_dev == shm:
                        inodes.add(st.st_ino)
    return {name: ino for name, ino in _shm_entries().items() if ino in inodes}


def _shm_entries() -> dict[str, int]:
    out = {}
    with os.scandir("/dev/shm") as it:
        for e in it:
            with contextlib.suppress(OSError):
                if e.is_file(follow_symlinks=False):
                    out[e.name] = e.inode()
    return out


def unlink_unheld(held: dict[str, int]) -> list[str]:
    """Unlink those of `held` (shm_held's answer for a tree now dead) that no live process maps or
    holds open and whose name still names the same inode; returns them. Only the dead tree's
    entries go in: another test's segment is never among them."""
    if not held:
        return []
    still = shm_held(_pids())
    now = _shm_entries()
    gone = []
    for name, ino in sorted(held.items()):
        if name not in still and now.get(name) == ino:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
                gone.append(name)
    return gone


def unused_port() -> int:
    """A loopback port nothing listens on (picked, then closed): for a master that is not there yet
    (a process started before its master, or one that must wait for it). The master refuses to
    share a port (so_reuseport off), so it cannot be held; were it taken meanwhile, the master's
    bind fails loudly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def omni_shm_entries(pids: list[int] | None = None) -> list[str]:
    """omni's /dev/shm entries; with `pids`, only those these processes made (`omni-shm-PID-...`)."""
    names = sorted(p for p in os.listdir("/dev/shm") if "omni" in p)
    if pids is None:
        return names
    return [n for n in names if n.startswith(tuple(f"omni-shm-{pid}-" for pid in pids))]


@contextlib.contextmanager
def served(*args: str, env: dict | None = None, timeout: float = 300.0):
    """`omni serve ARGS` for the block: yields its HTTP URL, then interrupts it (Ctrl-C)."""
    p = OmniProcess("serve", *args, env=env)
    try:
        yield p.http(timeout=timeout)
    finally:
        p.interrupt()


def pinned(url: str, index: str, tries: int = 200) -> httpx.Client:
    """A keep-alive client whose one connection is served by frontend `index`."""
    for _ in range(tries):
        c = httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1))
        if c.get("/health").headers.get("x-omni-frontend") == index:
            return c
        c.close()
    raise AssertionError(f"frontend {index} never answered in {tries} new connections")


def until_frontend(url: str, index: str, method: str, path: str, tries: int = 200, **kw) -> httpx.Response:
    c = pinned(url, index, tries)
    try:
        r = c.request(method, path, **kw)
    finally:
        c.close()
    assert r.headers["x-omni-frontend"] == index
    return r


def answer(r):
    """The answer's text and audio: OpenAI's shape (a request with an `audio` object: one choice, the text
    as the audio's transcript) or vllm-omni's (none: a text choice, then an audio choice)."""
    audio = next((c.message.audio for c in r.choices if c.message.audio), None)
    text = next((c.message.content for c in r.choices if not c.message.audio), None)
    if text is None and audio is not None:
        assert len(r.choices) == 1 and r.choices[0].message.content is None
        text = audio.transcript
    return SimpleNamespace(content=text, audio=audio)
