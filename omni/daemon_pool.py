"""A fixed pool of daemon threads for reads that may wait on another host (the frontend's output
reads, omni/orchestrator/fetch.py; a stage's remote input reads, omni/stage/input_reads.py).

Daemon threads, not a ThreadPoolExecutor's, which are joined at interpreter exit: a read stuck on a
silent host would hold the process's exit up to the transport's timeout, past the launcher's stop
grace. Nothing a read leaves half done needs finishing."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable


class DaemonPool:
    def __init__(self, threads: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        f: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((f, fn, args))
        return f

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            f, fn, args = job
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as e:
                f.set_exception(e)

    def shutdown(self) -> None:
        """Cancel the jobs not started; the running ones end on their own (their threads then stop)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
