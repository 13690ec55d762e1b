"""Voices shared by every frontend: stored once in the master's KV store (persisted
there when the master has a --state-dir), built-in voices always present. Names are
case-insensitive: "Mine" and "mine" are one voice, stored as "mine"."""

from __future__ import annotations

import json
from typing import Any

from omni.api.protocol_media import VOICE_NAME_RE
from omni.errors import BadRequest, Conflict, NotFound

NAMESPACE = "voices"
BUILTIN: dict[str, dict[str, Any]] = {"joe": {"name": "joe", "base": "joe", "speed": 1.0, "builtin": True}}


class MasterVoiceStore:
    def __init__(self, master: Any):
        self._master = master

    async def list(self) -> list[dict[str, Any]]:
        """Every voice; a preset an older omni stored under another case of a built-in or stored name ("JOE",
        "Mine" beside "mine") says which voice a request naming it gets (`shadowed_by`), and DELETE removes it."""
        stored = await self._master.kv_list(NAMESPACE)
        voices = {name: json.loads(blob) for name, blob in stored.items()}
        for name, v in voices.items():
            winner = _winner(name.lower(), voices)
            if name != winner:
                v["shadowed_by"] = winner
        return [dict(v) for v in {**voices, **BUILTIN}.values()]

    async def get(self, name: str) -> dict[str, Any]:
        found = await self._find(name)
        if found is None:
            raise NotFound(f"voice {name!r} does not exist")
        return found[1]

    async def add(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        key = name.lower()
        if key in BUILTIN:
            raise Conflict(f"voice {name!r} is built in and cannot be replaced")
        base = str(spec.get("base", "joe")).lower()
        if base not in BUILTIN:
            raise BadRequest(f"voice base {base!r} is not a built-in voice ({', '.join(BUILTIN)})")
        if await self._find(name) is not None:     # in any case, e.g. "Mine" stored under that case before
            raise Conflict(f"voice `{name}` already exists; delete it first")
        record = {"name": key, "base": base, "speed": float(spec.get("speed", 1.0)), "builtin": False}
        # Create-only in one call: of two frontends adding the name at once, one gets the 409.
        if not await self._master.kv_put(NAMESPACE, key, json.dumps(record).encode(), only_if_absent=True):
            raise Conflict(f"voice `{name}` already exists; delete it first")
        return record

    async def delete(self, name: str) -> None:
        # A record under this exact key first: one an older omni stored as "JOE" is shadowed by the built-in
        # voice (or "Mine" by "mine") and would otherwise hold a place of MAX_VOICES for good.
        if (name not in BUILTIN and _known_form(name, raising=False)
                and await self._master.kv_get(NAMESPACE, name) is not None
                and await self._master.kv_delete(NAMESPACE, name)):
            return
        if name.lower() in BUILTIN:
            raise Conflict(f"voice {name!r} is built in and cannot be deleted")
        found = await self._find(name)
        if found is None or not await self._master.kv_delete(NAMESPACE, found[0]):
            raise NotFound(f"voice {name!r} does not exist")

    async def _find(self, name: str) -> tuple[str, dict[str, Any]] | None:
        """(KV key, record) of a voice in any case. Voices are stored under the lower-cased name (vllm-omni
        lower-cases them); one stored before under another case is found by listing, on a miss only."""
        key = name.lower()
        if key in BUILTIN:
            return key, BUILTIN[key]
        if not _known_form(name, raising=False):
            return None
        blob = await self._master.kv_get(NAMESPACE, key)
        if blob is not None:
            return key, json.loads(blob)
        for k, b in (await self._master.kv_list(NAMESPACE)).items():
            if k.lower() == key:
                return k, json.loads(b)
        return None


def _known_form(name: str, raising: bool = True) -> bool:
    """Voices are added only under VOICE_NAME's rule: another name (over the KV's key length too, which the
    master would refuse with its own message) names none."""
    if VOICE_NAME_RE.match(name):
        return True
    if raising:
        raise NotFound(f"voice {name!r} does not exist")
    return False


def _winner(key: str, voices: dict[str, Any]) -> str:
    """The voice a request naming `key` in any case gets (as _find looks: built-in, the lower-cased
    record, else the first stored key of that name in the KV's order)."""
    if key in BUILTIN or key in voices:
        return key
    return min(n for n in voices if n.lower() == key)
