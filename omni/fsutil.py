"""Files written whole or not at all; temp folders a later launcher may sweep."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A temp file in `path`'s folder to write; fsynced and renamed over `path` when the block ends
    (removed if it raises): a reader (or a crash) sees the old content or the new, never a torn one.
    It is the owner's alone (mkstemp's 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


# In an omni-* temp folder: the pid of the process it belongs to, so a dead one's can be swept
# (sweep_stale_tmp, below).
OWNER_FILE = "launcher.pid"


def owned_tmp_dir(prefix: str = "omni-") -> str:
    """A 0700 temp folder naming this process as its owner; removed by its owner, or by the next
    launcher's sweep once this process is gone."""
    path = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return path


def owner_of(folder: str) -> int | None:
    """The pid an omni-* temp folder's owner file names; None where it names none."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def sweep_stale_tmp(root: str | None = None, owner: int | None = None) -> list[str]:
    """Remove the omni-* temp folders whose owner process is gone (SIGKILLed launchers, stages): only
    `owner`'s where one is given (a stage its launcher saw die). Folders without an owner file are not
    ours to judge."""
    from omni.deathsig import pid_exists

    swept = []
    for d in glob.glob(os.path.join(root or tempfile.gettempdir(), "omni-*")):
        pid = owner_of(d)
        if pid is None or (owner is not None and pid != owner) or pid_exists(pid):
            continue                          # its owner still runs (or someone else's process)
        shutil.rmtree(d, ignore_errors=True)
        swept.append(d)
        logger.info("removed %s, left by pid %d that is gone", d, pid)
    return swept


# Folders this process made that no exit of it may leave, os._exit included (where atexit runs nothing):
# a stage stopped while its vLLM engine loads never reaches the engine's shutdown.
_REMOVE_ON_EXIT: set[str] = set()


def remove_on_exit(path: str) -> None:
    """`path` is removed by remove_registered (the stage's exit paths call it) unless forgotten first."""
    _REMOVE_ON_EXIT.add(path)


def forget(path: str) -> None:
    """Its owner removed `path` (or handed it on): no exit path needs to."""
    _REMOVE_ON_EXIT.discard(path)


def remove_registered() -> list[str]:
    """Remove every folder registered with remove_on_exit; returns them."""
    gone = sorted(_REMOVE_ON_EXIT)
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    _REMOVE_ON_EXIT.difference_update(gone)
    return gone
