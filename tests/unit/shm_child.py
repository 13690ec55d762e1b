"""Run by test_harness_shm.py as a stand-in for a vLLM process tree: `hold NAME...` creates (or
opens) each /dev/shm/NAME, maps it and keeps it mapped; `tree A NAME...` maps A and starts a
`hold NAME...` child in its own process group (as a launcher starts its stages); `late A NAME...` says
"ready" first and starts that child on SIGUSR1 (a stage restarted later). Each says "ready" once all its
segments are mapped, then waits to be killed."""

import mmap
import os
import signal
import subprocess
import sys
import threading

SIZE = 1 << 16


def hold(name: str) -> mmap.mmap:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        return mmap.mmap(fd, SIZE)
    finally:
        os.close(fd)   # the mapping alone keeps it: only /proc/PID/maps shows it


if __name__ == "__main__":
    mode, first, *rest = sys.argv[1:]
    maps = [hold(first)]
    if mode == "hold":
        maps += [hold(n) for n in rest]
    if mode == "late":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        print("ready", flush=True)
        signal.sigwait({signal.SIGUSR1})
    if mode != "hold":
        child = subprocess.Popen([sys.executable, "-m", "tests.unit.shm_child", "hold", *rest],
                                 stdout=subprocess.PIPE, text=True, process_group=0)
        assert child.stdout.readline().strip() == "ready"
    if mode != "late":
        print("ready", flush=True)
    threading.Event().wait()
