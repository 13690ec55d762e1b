"""The KV store on disk: per namespace a snapshot (NS.json, written whole) and a log of the changes
since (NS.log, one JSON line a change, appended and fsynced before the change is answered).

A put appends one line instead of rewriting its namespace: the rewrite ran on the master's event
loop, the loop that serves heartbeats, and took 0.6 s at 62 MiB. When a log outgrows the live data
the snapshot is rewritten on a thread, entry by entry (the GIL passes between entries), while new
changes go to NS.log.next. A load replays snapshot, log and next in that order: a kill at any point
keeps every change that was answered.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from omni.errors import ConfigError
from omni.fsutil import atomic_file

logger = logging.getLogger(__name__)

MIN_COMPACT_BYTES = 4 << 20   # below this a log is never worth a rewrite
_SUFFIXES = (".log.next", ".json", ".log")   # namespaces may hold dots: the longest suffix is tried first

Entries = dict[str, tuple[bytes, float | None]]     # key -> (value, written at; None: not recorded)


@dataclass
class _Log:
    file: BinaryIO | None = None
    suffix: str = ".log"                     # ".log.next" while the snapshot is rewritten
    size: int = 0
    compactor: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Journal:
    def __init__(self, folder: Path):
        self._dir = folder
        self._lock = threading.Lock()        # the appends (event loop) against a compaction's switch (thread)
        self._logs: dict[str, _Log] = {}

    def load(self, persisted: Callable[[str], bool]) -> dict[str, Entries]:
        """Every namespace on disk that `persisted` keeps; the files of the others are removed."""
        for tmp in self._dir.glob(".*.tmp"):   # a snapshot the master was killed in writing: the old one stands
            logger.info("removing %s, left by an interrupted write", tmp)
            tmp.unlink(missing_ok=True)
        names = sorted({_namespace(p.name) for p in self._dir.iterdir() if p.name.endswith(_SUFFIXES)})
        data: dict[str, Entries] = {}
        for ns in names:
            if not persisted(ns):               # written by an older omni
                logger.info("removing the files of kv namespace %s: it is not persisted", ns)
                self._unlink(ns)
                continue
            entries = self._read_snapshot(self._path(ns, ".json"))
            for suffix in (".log", ".log.next"):
                self._replay(self._path(ns, suffix), entries)
            if entries and self._path(ns, ".log.next").exists():
                # a kill mid-rewrite: fold it now, else this master's appends (to .log) would replay before it
                self._write_snapshot(self._path(ns, ".json"), entries)
                for suffix in (".log", ".log.next"):
                    self._path(ns, suffix).unlink()
            if entries:
                data[ns] = entries
                self._logs[ns] = _Log(size=self._size(ns, ".log") + self._size(ns, ".log.next"))
            else:
                self._unlink(ns)
        return data

    def write(self, ns: str, key: str, value: bytes | None, at: float = 0.0) -> None:
        """Log a put (`value`) or a delete (None), durably."""
        rec = {"k": key, "d": 1} if value is None else {"k": key, "v": base64.b64encode(value).decode(), "t": at}
        self._append(ns, (json.dumps(rec) + "\n").encode())

    def delete_many(self, ns: str, keys: list[str]) -> None:
        """Log deletes of `keys` durably with one write and one fsync: an expiry of thousands of jobs,
        an fsync each, held the master's event loop (heartbeats): 0.9 s for 3,000 on a test VM."""
        if keys:
            self._append(ns, "".join(json.dumps({"k": k, "d": 1}) + "\n" for k in keys).encode())

    def _append(self, ns: str, line: bytes) -> None:
        with self._lock:
            log = self._logs.setdefault(ns, _Log())
            if log.file is None:
                # job prompts and voices are the users': the owner's alone, as the snapshots (mkstemp) are
                fd = os.open(self._path(ns, log.suffix), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                log.file = os.fdopen(fd, "ab")
            log.file.write(line)
            log.file.flush()
            os.fsync(log.file.fileno())
            log.size += len(line)

    def maybe_compact(self, ns: str, live_bytes: int, entries: Callable[[], Entries]) -> None:
        """Rewrite `ns`'s snapshot on a thread when its log has outgrown the live data; `entries()`
        makes the copy the thread writes (the store's own dicts change under it)."""
        with self._lock:
            log = self._logs.get(ns)
            if log is None or log.compactor is not None or log.size < max(MIN_COMPACT_BYTES, live_bytes):
                return
            self._close(log)
            log.suffix = ".log.next"
            log.done.clear()
            log.compactor = threading.Thread(target=self._compact, args=(ns, log, entries()),
                                             name=f"omni-kv-compact-{ns}", daemon=True)
            log.compactor.start()

    def drop(self, ns: str) -> None:
        """`ns` holds nothing now: remove its files (left to the next load while a snapshot is written)."""
        with self._lock:
            log = self._logs.get(ns)
            if log is not None and log.compactor is not None:
                return
            if log is not None:
                self._close(log)
                del self._logs[ns]
            self._unlink(ns)

    def wait_compacted(self, timeout: float) -> bool:
        """Whether every snapshot being rewritten was done within `timeout` seconds (tests, shutdown)."""
        with self._lock:
            pending = [log.done for log in self._logs.values() if log.compactor is not None]
        return all(done.wait(timeout) for done in pending)

    def close(self) -> None:
        self.wait_compacted(30.0)
        with self._lock:
            for log in self._logs.values():
                self._close(log)

    def _compact(self, ns: str, log: _Log, entries: Entries) -> None:
        try:
            self._write_snapshot(self._path(ns, ".json"), entries)
            with self._lock:
                nxt = self._path(ns, ".log.next")
                if nxt.exists():
                    os.replace(nxt, self._path(ns, ".log"))   # the open file follows its inode
                else:
                    self._path(ns, ".log").unlink(missing_ok=True)
                log.suffix = ".log"
                log.size = self._size(ns, ".log")
        except OSError:
            # the old snapshot and both logs stand and load whole; the next put tries again
            logger.exception("could not rewrite the snapshot of kv namespace %s", ns)
        finally:
            with self._lock:
                log.compactor = None
                log.done.set()

    def _write_snapshot(self, path: Path, entries: Entries) -> None:
        with atomic_file(path) as f:
            f.write(b"{")
            for i, key in enumerate(sorted(entries)):
                value, at = entries[key]
                rec = json.dumps({"v": base64.b64encode(value).decode(), "t": at})
                f.write(f'{", " if i else ""}{json.dumps(key)}: {rec}'.encode())
            f.write(b"}")

    def _read_snapshot(self, path: Path) -> Entries:
        if not path.exists():
            return {}
        try:
            raw = json.loads(path.read_text())
            # {"key": {"v": base64, "t": written}}; an older omni's file holds the base64 alone (no time: now)
            if not isinstance(raw, dict) or not all(isinstance(v, (str, dict)) for v in raw.values()):
                raise ValueError("expected one JSON object of entries")
            return {k: (base64.b64decode(v["v"] if isinstance(v, dict) else v, validate=True),
                        _time(v["t"]) if isinstance(v, dict) else None) for k, v in raw.items()}
        except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
            raise ConfigError(f"master state file {path} is damaged ({e}); fix or remove it") from None

    def _replay(self, path: Path, entries: Entries) -> None:
        if not path.exists():
            return
        data = path.read_bytes()
        lines = data.split(b"\n")
        good = 0                                  # bytes of whole, readable lines
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            if last and not line:
                break
            try:
                if last:                          # no newline: the write a kill cut short, never answered
                    raise ValueError("no newline")
                rec = json.loads(line)
                if "d" in rec:
                    entries.pop(rec["k"], None)
                else:
                    entries[str(rec["k"])] = (base64.b64decode(rec["v"], validate=True), float(rec["t"]))
            except (ValueError, KeyError, TypeError) as e:
                if not last:
                    raise ConfigError(f"master state file {path} is damaged at line {i + 1} ({e}); "
                                      f"fix or remove it") from None
                logger.warning("%s: dropping a cut-off last line (%d bytes) left by a kill mid-write", path, len(line))
                os.truncate(path, good)           # the next append must start on a line of its own
                return
            good += len(line) + 1

    def _path(self, ns: str, suffix: str) -> Path:
        return self._dir / f"{ns}{suffix}"

    def _size(self, ns: str, suffix: str) -> int:
        try:
            return self._path(ns, suffix).stat().st_size
        except FileNotFoundError:
            return 0

    def _unlink(self, ns: str) -> None:
        for suffix in _SUFFIXES:
            self._path(ns, suffix).unlink(missing_ok=True)

    @staticmethod
    def _close(log: _Log) -> None:
        if log.file is not None:
            log.file.close()
            log.file = None


def _time(t) -> float | None:
    return None if t is None else float(t)     # None: loaded from an older omni's file, not written since


def _namespace(filename: str) -> str:
    return next(filename[:-len(s)] for s in _SUFFIXES if filename.endswith(s))
