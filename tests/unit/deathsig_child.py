"""Imported by a spawn child of test_deathsig.py while it unpickles its target: there (and only
there) it says so on stdout and never returns, so the child stays inside its bootstrap."""

import threading
from pathlib import Path

# Not sys.argv: spawn replaces it with the parent's before unpickling.
if b"--multiprocessing-fork" in Path("/proc/self/cmdline").read_bytes().split(b"\0"):
    print("bootstrap", flush=True)
    threading.Event().wait()


def never_runs() -> None:
    raise AssertionError("the child left its bootstrap")
