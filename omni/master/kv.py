"""The master's small key-value store, one JSON file per namespace under state_dir/kv/.

Writes go to a temp file, are fsynced and renamed over the old one, so a crash leaves either
the old or the new namespace file, never a torn one.

Namespaces of live data (metrics) stay in memory only.

Every namespace is bounded (value size, entries, bytes; `LIMITS`), some expire entries a
while after their last write (jobs), and lists come in pages, so no client can make the
master or a reader of the list allocate without bound, and one oversize record cannot make
the list fail for everyone.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from omni.errors import ConfigError
from omni.fsutil import atomic_write

logger = logging.getLogger(__name__)

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
MAX_KEY_LEN = 1024
MAX_NAMESPACES = 64
PAGE_ENTRIES = 1000
PAGE_BYTES = 1 << 20     # far below gRPC's 4 MB message limit


@dataclass(frozen=True)
class Limits:
    max_value_bytes: int = 64 << 10
    max_entries: int = 10_000
    max_bytes: int = 64 << 20
    ttl_s: float | None = None          # entries go this long after their last write
    persist: bool = True                # written to state_dir (when the master has one)


# metrics: each frontend's last published exposition (omni/api/metrics_merge.py), live data that
# would be stale after a restart, so it is never written to disk.
LIMITS = {"jobs": Limits(ttl_s=7 * 86400.0), "voices": Limits(max_entries=1000), "metrics": Limits(persist=False)}
DEFAULT_LIMITS = Limits()
MAX_VALUE_BYTES = max(lim.max_value_bytes for lim in (DEFAULT_LIMITS, *LIMITS.values()))


class KvError(ValueError):
    """Bad namespace, key or value; the message says which."""


class KvFull(KvError):
    """A namespace (or the store) is at its limit."""


class KvStore:
    def __init__(self, state_dir: str | os.PathLike | None = None, limits: dict[str, Limits] | None = None,
                 clock=time.time):
        self._data: dict[str, dict[str, bytes]] = {}
        self._written: dict[str, dict[str, float]] = {}
        self._limits = {**LIMITS, **(limits or {})}
        self._clock = clock
        self._dir = Path(state_dir) / "kv" if state_dir else None
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._load()

    def _load(self) -> None:
        for tmp in self._dir.glob(".*.tmp"):   # a write the master was killed in: the old file stands
            logger.info("removing %s, left by an interrupted write", tmp)
            tmp.unlink(missing_ok=True)
        for path in sorted(self._dir.glob("*.json")):
            if not self.limits(path.stem).persist:   # written by an older omni
                logger.info("removing %s: namespace %s is not persisted", path, path.stem)
                path.unlink(missing_ok=True)
                continue
            try:
                raw = json.loads(path.read_text())
                now = self._clock()
                # {"key": {"v": base64, "t": written}}; older files hold the base64 alone
                if not isinstance(raw, dict) or not all(isinstance(v, (str, dict)) for v in raw.values()):
                    raise ValueError("expected one JSON object of entries")
                self._data[path.stem] = {k: base64.b64decode(v["v"] if isinstance(v, dict) else v, validate=True)
                                         for k, v in raw.items()}
                self._written[path.stem] = {k: float(v["t"]) if isinstance(v, dict) else now
                                            for k, v in raw.items()}
            except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
                raise ConfigError(f"master state file {path} is damaged ({e}); fix or remove it") from None
        logger.info("loaded %d kv namespaces from %s", len(self._data), self._dir)

    def limits(self, namespace: str) -> Limits:
        return self._limits.get(namespace, DEFAULT_LIMITS)

    def put(self, namespace: str, key: str, value: bytes, only_if_exists: bool = False) -> bool:
        """Store `value` at namespace/key; whether it did. `only_if_exists`: only over a value the key holds
        now (not expired), so an update cannot bring back what a delete removed; False when it held none."""
        _check(namespace, key)
        lim = self.limits(namespace)
        if len(value) > lim.max_value_bytes:
            raise KvError(f"value for {namespace}/{key[:64]} is {len(value)} bytes; the limit in namespace "
                          f"{namespace!r} is {lim.max_value_bytes}")
        self._expire(namespace)
        if namespace not in self._data and len(self._data) >= MAX_NAMESPACES:
            raise KvFull(f"the kv store holds {MAX_NAMESPACES} namespaces, the limit")
        if only_if_exists and key not in self._data.get(namespace, {}):
            return False
        items = self._data.setdefault(namespace, {})
        if key not in items and len(items) >= lim.max_entries:
            raise KvFull(f"kv namespace {namespace!r} holds {lim.max_entries} entries, the limit; delete some")
        used = sum(len(v) for v in items.values()) - len(items.get(key, b""))
        if used + len(value) > lim.max_bytes:
            raise KvFull(f"kv namespace {namespace!r} holds {used} bytes; {len(value)} more would pass its "
                         f"limit of {lim.max_bytes}")
        items[key] = bytes(value)
        self._written.setdefault(namespace, {})[key] = self._clock()
        self._persist(namespace)
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
        items = self._data.get(namespace, {})
        if key not in items:
            return False
        del items[key]
        self._written.get(namespace, {}).pop(key, None)
        self._persist(namespace)
        return True

    def _expired(self, namespace: str, key: str) -> bool:
        ttl = self.limits(namespace).ttl_s
        t = self._written.get(namespace, {}).get(key)
        return ttl is not None and t is not None and self._clock() - t > ttl

    def _expire(self, namespace: str) -> None:
        ttl = self.limits(namespace).ttl_s
        if ttl is None or namespace not in self._data:
            return
        written = self._written.get(namespace, {})
        old = [k for k, t in written.items() if self._clock() - t > ttl]
        for k in old:
            self._data[namespace].pop(k, None)
            written.pop(k, None)
        if old:
            logger.info("kv namespace %s: %d entries expired", namespace, len(old))
            self._persist(namespace)

    def _persist(self, namespace: str) -> None:
        if self._dir is None or not self.limits(namespace).persist:
            return
        target = self._dir / f"{namespace}.json"
        items = self._data.get(namespace, {})
        if not items:
            target.unlink(missing_ok=True)
            self._data.pop(namespace, None)
            self._written.pop(namespace, None)
            return
        written = self._written.get(namespace, {})
        text = json.dumps({k: {"v": base64.b64encode(v).decode(), "t": written.get(k, 0.0)}
                           for k, v in items.items()}, sort_keys=True)
        atomic_write(target, text.encode())


def _check(namespace: str, key: str | None) -> None:
    if not _NAMESPACE_RE.match(namespace or ""):
        raise KvError(f"bad kv namespace {namespace!r}: use 1-128 of [A-Za-z0-9_.-], not starting with '.' or '-'")
    if key is not None and not (0 < len(key) <= MAX_KEY_LEN):
        raise KvError(f"bad kv key in namespace {namespace!r}: must be 1-{MAX_KEY_LEN} characters")
