"""Named voice presets for /v1/audio/voices, and the in-memory store used in one-frontend setups and tests.

A store is anything with these async methods (the lead plugs in a master-backed one so
every frontend sees the same voices):
    list() -> list[{"name", "base", "speed", "builtin"}]
    get(name) -> one entry, the name in any case (optional; used when present, else list() is searched)
    add(name, spec: {"base", "speed"}) -> the stored entry
    delete(name) -> None
raising omni.errors.Conflict (built-in or duplicate), BadRequest or NotFound (unknown name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.api import protocol as P
from omni.api.browser import FORMS
from omni.api.errors import APIError
from omni.errors import Conflict, NotFound

if TYPE_CHECKING:
    from omni.api.state import FrontendState

# Voices a deployment keeps besides the built-in ones (the master's KV holds as many: a
# request past it gets a 400 naming this limit here, not the store's error).
MAX_VOICES = 1000


class VoiceStoreLike(Protocol):
    async def list(self) -> list[dict]: ...

    async def add(self, name: str, spec: dict) -> dict: ...

    async def delete(self, name: str) -> None: ...


class InMemoryVoiceStore:
    """Names are case-insensitive, stored lower-cased (as vllm-omni keeps them)."""

    def __init__(self, builtin: tuple[str, ...] = ("joe",)):
        self._voices: dict[str, dict] = {
            n.lower(): {"name": n.lower(), "base": n.lower(), "speed": 1.0, "builtin": True} for n in builtin}

    async def list(self) -> list[dict]:
        return [dict(v) for v in self._voices.values()]

    async def get(self, name: str) -> dict:
        v = self._voices.get(name.lower())
        if v is None:
            raise NotFound(f"voice `{name}` does not exist")
        return dict(v)

    async def add(self, name: str, spec: dict) -> dict:
        key = name.lower()
        if key in self._voices:
            raise Conflict(f"voice `{name}` already exists; delete it first")
        entry = {"name": key, "base": spec["base"].lower(), "speed": float(spec.get("speed", 1.0)),
                 "builtin": False}
        self._voices[key] = entry
        return dict(entry)

    async def delete(self, name: str) -> None:
        v = self._voices.get(name.lower())
        if v is None:
            raise NotFound(f"voice `{name}` does not exist")
        if v["builtin"]:
            raise Conflict(f"voice `{name}` is built in and cannot be deleted")
        del self._voices[name.lower()]


class VoiceRoutes:
    """/v1/audio/voices: list, add, delete named presets. A pipeline whose voices are the model's own
    speakers (Qwen-Omni: spoken through chat, no speech entry) lists them as built-in voices and keeps
    no presets: a speaker has no base or speed to set."""

    def __init__(self, fe: FrontendState):
        self.fe = fe

    def _need_voices(self) -> None:
        if not self.fe.speakers and self.fe.voices is None:
            raise APIError(404, "this pipeline has no voices (no stage speaks)", type="not_found_error")

    def _speaker_entries(self) -> list[dict]:
        return [{"name": s, "base": s, "speed": 1.0, "builtin": True} for s in self.fe.speakers]

    async def list(self, request: Request) -> Response:
        """omni's list (`data`) and vllm-omni's keys beside it: `voices` (every name) and `uploaded_voices`
        (the presets; vllm-omni's uploads, which clients check a name against)."""
        self._need_voices()
        voices = self._speaker_entries() if self.fe.speakers else await self.fe.voices.list()
        return JSONResponse({"object": "list", "data": voices, "voices": [v["name"] for v in voices],
                             "uploaded_voices": [v for v in voices if not v.get("builtin")]})

    async def add(self, request: Request) -> Response:
        self._need_voices()
        if request.headers.get("content-type", "").split(";", 1)[0].strip().lower() in FORMS:
            # vllm-omni's upload (-F name= -F audio_sample=@f.wav): refused unread
            raise APIError(400, "audio_sample: voice cloning (uploading a voice sample) is not supported by this "
                                "server; a POST of JSON {\"name\", \"base\", \"speed\"} makes a preset of a built-in "
                                "voice", param="audio_sample", code="voice_cloning_unsupported")
        if self.fe.speakers:
            raise APIError(400, "voice presets are not available for this pipeline: its voices are the model's "
                                f"speakers ({', '.join(self.fe.speakers)}), named in a chat's audio.voice, "
                                "with no base or speed to set", code="voice_presets_unsupported")
        spec = P.decode_body(await request.body(), P.VoiceSpec)
        voices = await self.fe.voices.list()
        builtin = [v["name"] for v in voices if v.get("builtin")]
        P.check_voice_spec(spec, builtin)
        if len(voices) - len(builtin) >= MAX_VOICES:
            raise APIError(400, f"this server already holds {MAX_VOICES} voices, the limit; delete one "
                                "(DELETE /v1/audio/voices/{name}) before adding another",
                           param="name", code="voice_limit_reached")
        entry = await self.fe.voices.add(spec.name, {"base": spec.base, "speed": spec.speed})
        return JSONResponse(entry, status_code=201)

    async def delete(self, request: Request) -> Response:
        self._need_voices()
        name = request.path_params["name"]
        if self.fe.speakers:      # as a store answers for its built-in voices and unknown names
            if name.lower() in self.fe.speakers:
                raise Conflict(f"voice `{name}` is built in and cannot be deleted")
            raise NotFound(f"voice `{name}` does not exist")
        await self.fe.voices.delete(name)
        return JSONResponse({"name": name, "deleted": True})

