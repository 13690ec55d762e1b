"""The master's small key-value store, kept in memory and, with a state_dir, on disk under
state_dir/kv/ as a snapshot and a log of changes per namespace (kv_journal.py).

Namespaces of live data (metrics) stay in memory only.

Every namespace is bounded (value size, entries, bytes of keys and values; `LIMITS`) and so is the
store, some expire entries a while after their last write (jobs), and lists come in pages, so no
client can make the master or a reader of the list allocate without bound, and one oversize record
cannot make the list fail for everyone.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from omni.errors import ConfigError
from omni.master.kv_journal import Journal

logger = logging.getLogger(__name__)

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
MAX_KEY_LEN = 1024
MAX_NAMESPACES = 64
PAGE_ENTRIES = 1000
PAGE_BYTES = 1 << 20     # far below gRPC's 4 MB message limit
MAX_TOTAL_BYTES = 256 << 20   # all namespaces: the defaults of jobs, voices and metrics fit with room
# What an entry costs beyond its key and value (CPython: ~120 B of dict slots, str/bytes headers and the
# written-at float), so 1 KiB keys with empty values count too and the caps bound the heap and the disk.
ENTRY_OVERHEAD = 128


@dataclass(frozen=True)
class Limits:
    max_value_bytes: int = 64 << 10
    max_entries: int = 10_000
    max_bytes: int = 64 << 20
    ttl_s: float | None = None          # entries go this long after their last write
    persist: bool = True                # written to state_dir (when the master has one)


# metrics: each frontend's last published exposition (omni/api/metrics_merge.py), live data that
# would be stale after a restart, so it is never written to disk. Its text grows with the stages and
# the voices used (~6.7 KB each): 3 MiB a value, under gRPC's 4 MiB message limit with the call around it.
LIMITS = {"jobs": Limits(ttl_s=7 * 86400.0), "voices": Limits(max_entries=1000),
          "metrics": Limits(max_value_bytes=3 << 20, max_entries=1000, persist=False)}
DEFAULT_LIMITS = Limits()
MAX_VALUE_BYTES = max(lim.max_value_bytes for lim in (DEFAULT_LIMITS, *LIMITS.values()))


class KvError(ValueError):
    """Bad namespace, key or value; the message says which."""


class KvFull(KvError):
    """A namespace (or the store) is at its limit."""


def check_state_dir(state_dir: str | os.PathLike, create: bool = True) -> Path:
    """`state_dir`'s kv folder, made (0700) unless not `create` (a dry run: only the nearest existing folder on
    its path is looked at). One it cannot be (a file on the path, a missing folder under /proc, no write
    permission) is a ConfigError naming --state-dir, before anything starts, not the master's traceback."""
    folder = Path(state_dir) / "kv"
    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)    # job prompts and voices are the users' (an older omni made it 0755)
        else:
            probe = folder
            while not probe.exists() and probe.parent != probe:
                probe = probe.parent
            if not probe.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(probe))
            if not os.access(probe, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(probe))
    except OSError as e:
        raise ConfigError(f"--state-dir {state_dir}: cannot keep the master's state there "
                          f"({e.strerror}: {e.filename})") from None
    return folder


class KvStore:
    def __init__(self, state_dir: str | os.PathLike | None = None, limits: dict[str, Limits] | None = None,
                 clock=time.time):
        self._data: dict[str, dict[str, bytes]] = {}
        self._written: dict[str, dict[str, float]] = {}
        self._bytes: dict[str, int] = {}      # each namespace's entry_bytes, kept as they change (no sum a put)
        self._limits = {**LIMITS, **(limits or {})}
        self._clock = clock
        self._journal = None
        if state_dir:
            folder = check_state_dir(state_dir)
            self._journal = Journal(folder)
            self._load(folder)

    def _load(self, folder: Path) -> None:
        now = self._clock()
        for ns, entries in self._journal.load(lambda ns: self.limits(ns).persist).items():
            self._data[ns] = {k: v for k, (v, _) in entries.items()}
            self._written[ns] = {k: now if t is None else t for k, (_, t) in entries.items()}
            self._bytes[ns] = sum(entry_bytes(k, v) for k, v in self._data[ns].items())
        logger.info("loaded %d kv namespaces from %s", len(self._data), folder)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()

    def limits(self, namespace: str) -> Limits:
        return self._limits.get(namespace, DEFAULT_LIMITS)

    def put(self, namespace: str, key: str, value: bytes, only_if_exists: bool = False,
            only_if_absent: bool = False) -> bool:
        """Store `value` at namespace/key; whether it did. `only_if_exists`: only over a value the key holds
        now (not expired), so an update cannot bring back what a delete removed; False when it held none.
        `only_if_absent`: only when the key holds none (create-only); False when it held one."""
        _check(namespace, key)
        lim = self.limits(namespace)
        if len(value) > lim.max_value_bytes:
            raise KvError(f"value for {namespace}/{key[:64]} is {len(value)} bytes; the limit in namespace "
                          f"{namespace!r} is {lim.max_value_bytes}")
        self._expire(namespace)
        if namespace not in self._data and len(self._data) >= MAX_NAMESPACES:
            raise KvFull(f"the kv store holds {MAX_NAMESPACES} namespaces, the limit")
        held = key in self._data.get(namespace, {})
        if (only_if_exists and not held) or (only_if_absent and held):
            return False
        items = self._data.get(namespace, {})
        if key not in items and len(items) >= lim.max_entries:
            raise KvFull(f"kv namespace {namespace!r} holds {lim.max_entries} entries, the limit; delete some")
        grow = len(value) - len(items[key]) if key in items else entry_bytes(key, value)
        used = self._bytes.get(namespace, 0)
        if used + grow > lim.max_bytes:
            raise KvFull(f"kv namespace {namespace!r} holds {used} bytes; {grow} more would pass its "
                         f"limit of {lim.max_bytes}")
        total = sum(self._bytes.values())
        if total + grow > MAX_TOTAL_BYTES:
            raise KvFull(f"the kv store holds {total} bytes; {grow} more would pass its limit of "
                         f"{MAX_TOTAL_BYTES}; delete some")
        at = self._clock()
        self._log(namespace, key, value, at)      # on disk before it is answered
        self._data.setdefault(namespace, {})[key] = bytes(value)
        self._written.setdefault(namespace, {})[key] = at
        self._bytes[namespace] = used + grow
        self._compact(namespace)
        return True

    def get(self, namespace: str, key: str) -> bytes | None:
        _check(namespace, key)
        if self._expired(namespace, key):
            return None
        return self._data.get(namespace, {}).get(key)

    def list(self, namespace: str, prefix: str = "", limit: int = 0,
             start_after: str = "") -> tuple[dict[str, bytes], str]:
        """One page of the entries under `prefix` after `start_after`: at most `limit`
        (0: PAGE_ENTRIES) entries and about PAGE_BYTES; returns (page, next start_after or "")."""
        _check(namespace, None)
        self._expire(namespace)
        items = self._data.get(namespace, {})
        limit = min(limit or PAGE_ENTRIES, PAGE_ENTRIES)
        page: dict[str, bytes] = {}
        size = 0
        for k in sorted(items):
            if not k.startswith(prefix) or (start_after and k <= start_after):
                continue
            if len(page) >= limit or (page and size + len(items[k]) > PAGE_BYTES):
                return page, max(page)
            page[k] = items[k]
            size += len(k) + len(items[k])
        return page, ""

    def delete(self, namespace: str, key: str) -> bool:
        _check(namespace, key)
        if key not in self._data.get(namespace, {}):
            return False
        self._log(namespace, key, None)
        self._remove(namespace, [key])
        return True

    def _expired(self, namespace: str, key: str) -> bool:
        ttl = self.limits(namespace).ttl_s
        t = self._written.get(namespace, {}).get(key)
        return ttl is not None and t is not None and self._clock() - t > ttl

    def _expire(self, namespace: str) -> None:
        ttl = self.limits(namespace).ttl_s
        if ttl is None or namespace not in self._data:
            return
        now = self._clock()
        old = [k for k, t in self._written.get(namespace, {}).items() if now - t > ttl]
        if old:
            logger.info("kv namespace %s: %d entries expired", namespace, len(old))
            if self._journal is not None and self.limits(namespace).persist:
                self._journal.delete_many(namespace, old)   # one fsync for all: this runs on the master's loop
            self._remove(namespace, old)

    def _remove(self, namespace: str, keys: list[str]) -> None:
        items, written = self._data[namespace], self._written.setdefault(namespace, {})
        for k in keys:
            self._bytes[namespace] -= entry_bytes(k, items.pop(k))
            written.pop(k, None)
        if items:
            self._compact(namespace)
            return
        for d in (self._data, self._written, self._bytes):   # an empty namespace counts for no limit
            d.pop(namespace, None)
        if self._journal is not None and self.limits(namespace).persist:
            self._journal.drop(namespace)

    def _log(self, namespace: str, key: str, value: bytes | None, at: float = 0.0) -> None:
        if self._journal is not None and self.limits(namespace).persist:
            self._journal.write(namespace, key, value, at)

    def _compact(self, namespace: str) -> None:
        if self._journal is not None and self.limits(namespace).persist:
            items, written = self._data[namespace], self._written[namespace]
            on_disk = self._bytes[namespace] - ENTRY_OVERHEAD * len(items)   # the overhead is the heap's
            self._journal.maybe_compact(namespace, on_disk,
                                        lambda: {k: (v, written[k]) for k, v in items.items()})


def entry_bytes(key: str, value: bytes) -> int:
    """What one entry counts against the caps: its key (UTF-8), its value and ENTRY_OVERHEAD."""
    return len(key.encode("utf-8", "surrogatepass")) + len(value) + ENTRY_OVERHEAD


def _check(namespace: str, key: str | None) -> None:
    if not _NAMESPACE_RE.fullmatch(namespace or ""):   # match's `$` takes a final "\n" too
        raise KvError(f"bad kv namespace {namespace!r}: use 1-128 of [A-Za-z0-9_.-], not starting with '.' or '-'")
    if key is not None and not (0 < len(key) <= MAX_KEY_LEN):
        raise KvError(f"bad kv key in namespace {namespace!r}: must be 1-{MAX_KEY_LEN} characters")
