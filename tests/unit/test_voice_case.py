"""Voice names in any case (docs: "any case"; vllm-omni lower-cases them): built-in voices and presets
are found as JOE or Joe, a preset is stored lower-cased so "Mine" and "mine" are one name (409), and a
preset stored under another case before is still found and deleted."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from omni.api import InMemoryVoiceStore, build_app
from omni.voices import NAMESPACE, MasterVoiceStore
from tests.unit.api_fakes import FakeOrchestrator, assert_error, tokenizer  # noqa: F401
from tests.unit.test_voice_create_race import FakeMaster

pytestmark = pytest.mark.anyio


class DeletingMaster(FakeMaster):
    async def kv_delete(self, ns, k):
        await asyncio.sleep(0.001)
        return self.kv.delete(ns, k)


def _client(tokenizer, voices):  # noqa: F811
    orch = FakeOrchestrator(tokenizer)
    orch.audio_chunks = 1
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, speech_entry_stage=1, voices=voices)
    return orch, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.mark.parametrize("store", ["memory", "master"])
async def test_voice_names_in_any_case(tokenizer, store):  # noqa: F811
    voices = InMemoryVoiceStore(("joe",)) if store == "memory" else MasterVoiceStore(DeletingMaster())
    orch, c = _client(tokenizer, voices)
    async with c:
        for asked in ("JOE", "Joe", "joe"):
            r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": asked})
            assert r.status_code == 200, r.text
            assert orch.requests[-1].voice == "joe"
        r = await c.post("/v1/audio/voices", json={"name": "Mine", "base": "JOE", "speed": 0.5})
        assert r.status_code == 201, r.text
        assert r.json()["name"] == "mine" and r.json()["base"] == "joe"
        for asked in ("mine", "MINE", "Mine"):
            r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": asked})
            assert r.status_code == 200, r.text
            assert (orch.requests[-1].voice, orch.requests[-1].speed) == ("joe", 0.5)
        assert_error(await c.post("/v1/audio/voices", json={"name": "mine"}), 409)
        assert (await c.delete("/v1/audio/voices/MINE")).status_code == 200
        assert_error(await c.post("/v1/audio/speech", json={"input": "hi", "voice": "mine"}), 404, "voice")
        assert_error(await c.delete("/v1/audio/voices/Joe"), 409)


async def test_a_preset_stored_under_another_case_is_still_found(tokenizer):  # noqa: F811
    master = DeletingMaster()     # stored before names were lower-cased
    master.kv.put(NAMESPACE, "Old", json.dumps({"name": "Old", "base": "joe", "speed": 2.0, "builtin": False}).encode())
    orch, c = _client(tokenizer, MasterVoiceStore(master))
    async with c:
        r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": "old"})
        assert r.status_code == 200, r.text
        assert orch.requests[-1].speed == 2.0
        assert_error(await c.post("/v1/audio/voices", json={"name": "OLD"}), 409)
        assert (await c.delete("/v1/audio/voices/oLd")).status_code == 200
        assert master.kv.get(NAMESPACE, "Old") is None


async def test_a_preset_stored_under_a_shadowed_name_is_listed_as_such_and_deleted_by_its_own_name(tokenizer):  # noqa: F811
    """Before: an older omni's "JOE" preset (and "Mine" beside "mine") was listed as a voice of its own, a request
    naming it got another voice, and DELETE /v1/audio/voices/JOE was a 409 'built in': a MAX_VOICES place for good."""
    master = DeletingMaster()
    for name in ("JOE", "Mine", "mine"):
        master.kv.put(NAMESPACE, name, json.dumps({"name": name, "base": "joe", "speed": 2.0 if name != "mine" else 0.5,
                                                   "builtin": False}).encode())
    orch, c = _client(tokenizer, MasterVoiceStore(master))
    async with c:
        listed = {v["name"]: v for v in (await c.get("/v1/audio/voices")).json()["data"]}
        assert listed["JOE"]["shadowed_by"] == "joe" and listed["Mine"]["shadowed_by"] == "mine"
        assert "shadowed_by" not in listed["joe"] and "shadowed_by" not in listed["mine"]
        r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": "JOE"})
        assert r.status_code == 200 and orch.requests[-1].speed != 2.0   # the built-in voice, as listed
        assert (await c.delete("/v1/audio/voices/JOE")).status_code == 200
        assert (await c.delete("/v1/audio/voices/Mine")).status_code == 200
        assert master.kv.get(NAMESPACE, "JOE") is None and master.kv.get(NAMESPACE, "Mine") is None
        assert master.kv.get(NAMESPACE, "mine") is not None
        assert_error(await c.delete("/v1/audio/voices/JOE"), 409)      # now only the built-in voice
        assert_error(await c.delete("/v1/audio/voices/joe"), 409)
        assert [v["name"] for v in (await c.get("/v1/audio/voices")).json()["data"]] == ["mine", "joe"]


async def test_presets_differing_only_in_case_list_the_one_a_request_gets(tokenizer):  # noqa: F811
    """An older omni's "MINE" and "Mine" with no "mine": a request for either gets the first in the KV's
    order; the other was listed as a voice of its own."""
    master = DeletingMaster()
    for name, speed in (("MINE", 2.0), ("Mine", 0.5)):
        master.kv.put(NAMESPACE, name, json.dumps({"name": name, "base": "joe", "speed": speed,
                                                   "builtin": False}).encode())
    orch, c = _client(tokenizer, MasterVoiceStore(master))
    async with c:
        listed = {v["name"]: v for v in (await c.get("/v1/audio/voices")).json()["data"]}
        assert "shadowed_by" not in listed["MINE"] and listed["Mine"]["shadowed_by"] == "MINE"
        r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": "Mine"})
        assert r.status_code == 200 and orch.requests[-1].speed == 2.0   # MINE's, as listed
