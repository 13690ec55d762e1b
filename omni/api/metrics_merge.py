"""One /metrics view of every frontend: each frontend publishes its own exposition text to the
master's KV store (namespace `metrics`, key = its index) every PUBLISH_S; whichever frontend answers
/metrics merges its fresh text with the live others' by metric family (each family's HELP/TYPE once,
the samples of every frontend under it; their `frontend` label tells them apart)."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Callable

from omni.errors import BadRequest
from omni.ratelog import RateLimitedLog

NAMESPACE = "metrics"
PUBLISH_S = 2.0
_SUFFIXES = ("_bucket", "_sum", "_count")
_HEADER = re.compile(r"^# (HELP|TYPE) (\S+)")
_refused = RateLimitedLog(logging.getLogger(__name__))


class Publisher:
    """Writes a frontend's text to the KV store, one write at a time: each write is a text rendered
    after the one before, so the stored copy, which every frontend's /metrics serves, never goes back.
    Scrapes that queue behind a write share the next one (each scrape had been a master write of its own:
    a burst of N unauthenticated scrapes was N writes in a row)."""

    def __init__(self, render: Callable[[], str], amaster: Any, index: int):
        self._render, self._master, self._key = render, amaster, str(index)
        self._lock = asyncio.Lock()
        self._asked = 0            # calls so far
        self._covered = 0          # the calls made before the newest published text was rendered
        self._text = ""

    async def publish(self) -> str:
        """The text published, rendered after this call began; raises when the master did not take it."""
        self._asked += 1
        ticket = self._asked
        async with self._lock:
            if self._covered >= ticket:   # a write rendered after this call was made went out meanwhile
                return self._text
            covers = self._asked
            text = self._render()
            try:
                await self._master.kv_put(NAMESPACE, self._key, text.encode())
            except BadRequest as e:    # too large (or the store full): a frozen old copy would mislead
                _refused.warning("metrics of frontend %s not published (%d bytes): %s; its old copy is "
                                 "removed, so the other frontends' /metrics leave it out", self._key,
                                 len(text), e)
                try:
                    await self._master.kv_delete(NAMESPACE, self._key)
                except Exception:
                    pass
                raise
            self._covered, self._text = covers, text
            return text


def _family(sample: str, known: dict) -> str:
    name = sample.split("{", 1)[0].split(" ", 1)[0]
    if name in known:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in known:
            return name[: -len(suffix)]
    return name


def merge(texts: list[str]) -> str:
    families: dict[str, tuple[list[str], list[str]]] = {}   # name -> (header lines, samples)
    for text in texts:
        for line in text.splitlines():
            if not line.strip():
                continue
            m = _HEADER.match(line)
            if m:
                headers, _ = families.setdefault(m.group(2), ([], []))
                if line not in headers:
                    headers.append(line)
            elif line.startswith("#"):
                continue
            else:
                families.setdefault(_family(line, families), ([], []))[1].append(line)
    out = []
    for headers, samples in families.values():
        out += headers + samples
    return "\n".join(out) + "\n"
