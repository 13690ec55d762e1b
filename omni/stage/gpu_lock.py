"""One engine load at a time per GPU on a host.

vLLM sizes a stage's KV cache from the GPU's free memory as it profiles, so stages that share a GPU
and load at once (qwen3-omni-moe-1gpu: thinker, talker and code2wav on GPU 0) see each other's weights
arrive mid-profile, and the thinker may be left "No available memory for the cache blocks". A stage
pinned to GPUs (`devices` "0", "0,1") takes an exclusive flock per GPU, in a fixed order, around its
engine load; CPU stages (`cpu`) and unpinned ones (`""`: whatever is visible) take none.

The lock files live in this user's run folder (omni/runfile.py), used only if it is ours alone; where
it is not, loads are not serialised and a note says why. The holder writes its label and pid into the
file, so a waiter can say whom it waits for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterator

from omni import runfile

NOTE_EVERY_S = 60.0
POLL_S = 0.1


def pinned_gpus(devices: str) -> list[str]:
    """The GPUs a stage's `devices` pin it to, as its CUDA_VISIBLE_DEVICES names them once
    select_devices has run (indices of an outer selection mapped through it); [] for cpu or unpinned."""
    devices = (devices or "").strip().lower()
    if devices in ("", "cpu"):
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", devices)
    return sorted({d.strip() for d in visible.split(",") if d.strip()})


def lock_folder() -> Path:
    return runfile.run_dir() / "gpu-locks"


@contextlib.contextmanager
def one_load_per_gpu(devices: str, label: str, say: Callable[[str], None],
                     folder: Path | None = None) -> Iterator[None]:
    """Hold every GPU `devices` pins the stage to while the body (the engine load) runs."""
    gpus = pinned_gpus(devices)
    if not gpus:
        yield
        return
    folder = lock_folder() if folder is None else folder
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = runfile.untrusted(folder)
    except OSError as e:
        why = f"cannot be made: {e}"
    if why is not None:
        say(f"{label}: engine loads on GPU {','.join(gpus)} are not serialised: lock folder {folder} {why}")
        yield
        return
    fds: list[int] = []
    try:
        for gpu in gpus:       # one order for every stage: two multi-GPU stages cannot deadlock
            fds.append(_take(folder / f"gpu-{re.sub(r'[^A-Za-z0-9._-]', '_', gpu)}.lock", gpu, label, say))
        yield
    finally:
        for fd in fds:
            # LOCK_UN, not only close: a process the engine forked holds a copy of the fd, and the
            # lock (the open file's) would stay held for as long as it lives
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _take(path: Path, gpu: str, label: str, say: Callable[[str], None]) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        t0, noted = time.monotonic(), None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if noted is None or time.monotonic() - noted >= NOTE_EVERY_S:
                noted = time.monotonic()
                say(f"{label}: waiting for GPU {gpu} ({noted - t0:.0f} s): {_holder(path)} is loading its "
                    "engine there (one load at a time per GPU)")
            time.sleep(POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{label} (pid {os.getpid()})".encode(), 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _holder(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip() or "another stage"
    except OSError:
        return "another stage"
