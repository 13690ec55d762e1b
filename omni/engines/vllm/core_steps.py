"""The EngineCore's count of model steps, shared with its stage (pipeline.loop_stall_s).

vLLM's core sends nothing for a step that finishes no token (a chunk of a long prefill; with its log stats
off, not even stats), so a CPU prefill longer than loop_stall_s looked like a hung EngineCore and the stage
stopped heartbeating. The core bumps a counter in an 8-byte file after each step that ran the model; the
stage reads it on each of its own steps and counts a change as progress. The core unlinks the file once it has
mapped it (one core per engine: omni runs data_parallel_size 1); until then it lives in the stage's own vLLM
folder where there is one (omni/engines/vllm/args.prepare_env: swept once the stage is gone), so a stage
killed while its core starts leaves nothing for long.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import struct
import tempfile

logger = logging.getLogger(__name__)

ENV = "OMNI_CORE_STEPS_FILE"
_COUNT = struct.Struct("<Q")


class CoreSteps:
    """The stage's side: makes the file and reads the count."""

    def __init__(self, folder: str | None = None) -> None:
        fd, self.path = tempfile.mkstemp(prefix="omni-core-steps-", dir=folder)   # mode 0600
        try:
            os.ftruncate(fd, _COUNT.size)
            self._map: mmap.mmap | None = mmap.mmap(fd, _COUNT.size)
        finally:
            os.close(fd)
        self._seen = 0

    @contextlib.contextmanager
    def shared(self):
        """While the EngineCore starts: it finds the file through the environment it inherits."""
        os.environ[ENV] = self.path
        try:
            yield
        finally:
            os.environ.pop(ENV, None)
            self.unlink()   # the core mapped it before it said it was ready, or it never will

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def advanced(self) -> bool:
        """Whether the core ran the model since the last call."""
        if self._map is None:
            return False
        n = _COUNT.unpack_from(self._map)[0]
        if n == self._seen:
            return False
        self._seen = n
        return True

    def close(self) -> None:
        self.unlink()
        if self._map is not None:
            self._map.close()
            self._map = None


def count_core_steps() -> None:
    """The EngineCore's side, in its process before the core is built: each step of EngineCore's that ran
    the model (its second result) bumps the count. Nothing when the stage shared no file."""
    path = os.environ.pop(ENV, None)
    if not path:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as e:
        logger.warning("EngineCore step count off (%s): a long prefill may count as a stall", e)
        return
    try:
        counter = mmap.mmap(fd, _COUNT.size)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)   # mapped: the count lives on; the name is not needed
    from vllm.v1.engine.core import EngineCore

    done = [0]

    def counting(step):
        @functools.wraps(step)
        def wrapper(self, *args, **kwargs):
            result = step(self, *args, **kwargs)
            if result[1]:
                done[0] += 1
                _COUNT.pack_into(counter, 0, done[0])
            return result
        return wrapper

    for name in ("step", "step_with_batch_queue"):
        setattr(EngineCore, name, counting(getattr(EngineCore, name)))
