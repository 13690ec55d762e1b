"""The master's small key-value store, one JSON file per namespace under state_dir/kv/.

Writes go to a temp file, are fsynced and renamed over the old one, so a crash leaves either
the old or the new namespace file, never a torn one.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from pathlib import Path

from omni.errors import ConfigError
from omni.fsutil import atomic_write

logger = logging.getLogger(__name__)

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
MAX_KEY_LEN = 1024
MAX_VALUE_BYTES = 2 * 1024 * 1024


class KvError(ValueError):
    """Bad namespace, key or value; the message says which."""


class KvStore:
    def __init__(self, state_dir: str | os.PathLike | None = None):
        self._data: dict[str, dict[str, bytes]] = {}
        self._dir = Path(state_dir) / "kv" if state_dir else None
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._load()

    def _load(self) -> None:
        for tmp in self._dir.glob(".*.tmp"):   # a write the master was killed in: the old file stands
            logger.info("removing %s, left by an interrupted write", tmp)
            tmp.unlink(missing_ok=True)
        for path in sorted(self._dir.glob("*.json")):
            try:
                raw = json.loads(path.read_text())
                if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
                    raise ValueError("expected one JSON object of base64 strings")
                self._data[path.stem] = {k: base64.b64decode(v, validate=True) for k, v in raw.items()}
            except (OSError, ValueError) as e:
                raise ConfigError(f"master state file {path} is damaged ({e}); fix or remove it") from None
        logger.info("loaded %d kv namespaces from %s", len(self._data), self._dir)

    def put(self, namespace: str, key: str, value: bytes) -> None:
        _check(namespace, key)
        if len(value) > MAX_VALUE_BYTES:
            raise KvError(f"value for {namespace}/{key} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES}")
        self._data.setdefault(namespace, {})[key] = bytes(value)
        self._persist(namespace)

    def get(self, namespace: str, key: str) -> bytes | None:
        _check(namespace, key)
        return self._data.get(namespace, {}).get(key)

    def list(self, namespace: str, prefix: str = "") -> dict[str, bytes]:
        _check(namespace, None)
        items = self._data.get(namespace, {})
        return {k: items[k] for k in sorted(items) if k.startswith(prefix)}

    def delete(self, namespace: str, key: str) -> bool:
        _check(namespace, key)
        items = self._data.get(namespace, {})
        if key not in items:
            return False
        del items[key]
        self._persist(namespace)
        return True

    def _persist(self, namespace: str) -> None:
        if self._dir is None:
            return
        target = self._dir / f"{namespace}.json"
        items = self._data.get(namespace, {})
        if not items:
            target.unlink(missing_ok=True)
            return
        text = json.dumps({k: base64.b64encode(v).decode() for k, v in items.items()}, sort_keys=True)
        atomic_write(target, text.encode())


def _check(namespace: str, key: str | None) -> None:
    if not _NAMESPACE_RE.match(namespace or ""):
        raise KvError(f"bad kv namespace {namespace!r}: use 1-128 of [A-Za-z0-9_.-], not starting with '.' or '-'")
    if key is not None and not (0 < len(key) <= MAX_KEY_LEN):
        raise KvError(f"bad kv key in namespace {namespace!r}: must be 1-{MAX_KEY_LEN} characters")
