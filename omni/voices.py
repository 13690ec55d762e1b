"""Voices shared by every frontend: stored once in the master's KV store (persisted
there when the master has a --state-dir), built-in voices always present."""

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
        stored = await self._master.kv_list(NAMESPACE)
        voices = {name: json.loads(blob) for name, blob in stored.items()}
        return [dict(v) for v in {**voices, **BUILTIN}.values()]

    async def get(self, name: str) -> dict[str, Any]:
        if name in BUILTIN:
            return BUILTIN[name]
        _known_form(name)
        blob = await self._master.kv_get(NAMESPACE, name)
        if blob is None:
            raise NotFound(f"voice {name!r} does not exist")
        return json.loads(blob)

    async def add(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        if name in BUILTIN:
            raise Conflict(f"voice {name!r} is built in and cannot be replaced")
        base = spec.get("base", "joe")
        if base not in BUILTIN:
            raise BadRequest(f"voice base {base!r} is not a built-in voice ({', '.join(BUILTIN)})")
        record = {"name": name, "base": base, "speed": float(spec.get("speed", 1.0)), "builtin": False}
        # Create-only in one call: of two frontends adding the name at once, one gets the 409.
        if not await self._master.kv_put(NAMESPACE, name, json.dumps(record).encode(), only_if_absent=True):
            raise Conflict(f"voice `{name}` already exists; delete it first")
        return record

    async def delete(self, name: str) -> None:
        if name in BUILTIN:
            raise Conflict(f"voice {name!r} is built in and cannot be deleted")
        _known_form(name)
        if not await self._master.kv_delete(NAMESPACE, name):
            raise NotFound(f"voice {name!r} does not exist")


def _known_form(name: str) -> None:
    """Voices are added only under VOICE_NAME's rule: another name (over the KV's key length too, which the
    master would refuse with its own message) names none."""
    if not VOICE_NAME_RE.match(name):
        raise NotFound(f"voice {name!r} does not exist")
