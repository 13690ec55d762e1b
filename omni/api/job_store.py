"""Where async jobs (omni/api/jobs.py) keep things: records as the master's KV stores them (`encode_record`;
`LocalKv`, the KV in memory for a frontend without a master), and result bytes (`Results`: files in the
directory every frontend shares, or memory)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import stat
import time
from pathlib import Path

from starlette.responses import FileResponse, Response

from omni.fsutil import atomic_write

log = logging.getLogger(__name__)

JOB_ID_RE = re.compile(r"^(job-|video_)[0-9a-f]{32}$")   # video_: the Videos API's (omni/api/videos.py)
# A result write's temp file (omni/fsutil.py's atomic_write: ".<job id>.<random>.tmp"), with its job id.
TEMP_RE = re.compile(r"^\.((?:job-|video_)[0-9a-f]{32})\.[^/]*\.tmp$")
# A temp file this old is a write that never ended (its frontend killed mid-write): a write takes seconds.
TEMP_MAX_AGE_S = 3600.0


class LocalKv:
    """The master client's four KV calls, in memory: jobs of one frontend without a master (tests)."""

    def __init__(self):
        self._data: dict[str, dict[str, bytes]] = {}

    async def kv_put(self, namespace: str, key: str, value: bytes, only_if_exists: bool = False) -> bool:
        """Whether it wrote: `only_if_exists` writes only over a value the key holds now (the master's rule)."""
        if only_if_exists and key not in self._data.get(namespace, {}):
            return False
        self._data.setdefault(namespace, {})[key] = bytes(value)
        return True

    async def kv_get(self, namespace: str, key: str) -> bytes | None:
        return self._data.get(namespace, {}).get(key)

    async def kv_list(self, namespace: str, prefix: str = "", max_entries: int = 100_000,
                      start_after: str = "") -> dict[str, bytes]:
        items = self._data.get(namespace, {})
        keys = [k for k in sorted(items) if k.startswith(prefix) and k > start_after]
        return {k: items[k] for k in keys[:max_entries]}

    async def kv_delete(self, namespace: str, key: str) -> bool:
        return self._data.get(namespace, {}).pop(key, None) is not None


class Results:
    """Result bytes by job id: files in a directory the frontends share, or memory without one."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self._dir = Path(directory) if directory else None
        self._mem: dict[str, bytes] = {}
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)

    async def put(self, job_id: str, data: bytes) -> None:
        if self._dir is None:
            self._mem[job_id] = data
        else:
            # Not abandoned when the job is cancelled: the cancel's delete comes after the file
            # lands, or the write would leave an orphan result behind it.
            write = asyncio.ensure_future(asyncio.to_thread(self._write, job_id, data))
            cancelled = False
            while not write.done():
                try:
                    await asyncio.shield(write)
                except asyncio.CancelledError:
                    cancelled = True
            if cancelled:
                raise asyncio.CancelledError
            write.result()

    def _write(self, job_id: str, data: bytes) -> None:
        atomic_write(self._dir / job_id, data)   # a reader sees the whole result or none

    async def get(self, job_id: str) -> bytes | None:
        if self._dir is None:
            return self._mem.get(job_id)
        try:
            return await asyncio.to_thread((self._dir / job_id).read_bytes)
        except FileNotFoundError:
            return None

    async def response(self, job_id: str, media_type: str | None) -> Response | None:
        """The result as an HTTP answer, None when it is gone: the file streamed from the folder (not read whole
        into memory; Range requests served), or the bytes held in memory. Only a regular file in the folder is
        a result: a symlink there is not followed."""
        if self._dir is None:
            data = self._mem.get(job_id)
            return None if data is None else Response(data, media_type=media_type)
        path = self._dir / job_id
        try:
            st = await asyncio.to_thread(os.lstat, path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            log.warning("job result %s is not a regular file; not served", path)
            return None
        return FileResponse(path, stat_result=st, media_type=media_type)

    async def ids(self) -> list[str]:
        """The jobs that have a result here (temp files of writes under way are not results)."""
        if self._dir is None:
            return list(self._mem)
        return await asyncio.to_thread(lambda: [p.name for p in self._dir.iterdir() if JOB_ID_RE.match(p.name)])

    async def remove_stale_temps(self, keep: set[str] | frozenset[str] = frozenset(),
                                 older_than_s: float = TEMP_MAX_AGE_S) -> list[str]:
        """Remove the temp files of result writes last written over `older_than_s` ago, left by a frontend
        killed while writing; never one of a job in `keep` (this frontend's unfinished jobs: maybe being
        written now). Their names."""
        if self._dir is None:
            return []
        keep = frozenset(keep)

        def run() -> list[str]:
            now, removed = time.time(), []
            for p in self._dir.iterdir():
                m = TEMP_RE.match(p.name)
                if m is None or m.group(1) in keep:
                    continue
                try:
                    st = p.lstat()
                    if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than_s:
                        p.unlink()
                        removed.append(p.name)
                except FileNotFoundError:
                    continue
            return removed

        return await asyncio.to_thread(run)

    async def delete(self, job_id: str) -> None:
        if self._dir is None:
            self._mem.pop(job_id, None)
        else:
            (self._dir / job_id).unlink(missing_ok=True)


def encode_record(record: dict) -> bytes:
    """A record as the KV stores it: UTF-8 JSON. ASCII-escaped, an emoji took 12 bytes, and a video's prompt
    and negative prompt of 4000 each passed the KV's 64 KiB value cap; as UTF-8 a character takes at most 6
    bytes (a control character's \\u00XX escape), and the largest video record fits
    (tests/unit/test_api_videos.py)."""
    try:
        return json.dumps(record, ensure_ascii=False).encode()
    except UnicodeEncodeError:     # a lone surrogate (no route lets one in): escaped, as before
        return json.dumps(record).encode()
