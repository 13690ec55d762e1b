"""A voice added through two frontends at once: one 201, one 409, the first one stored (KvPut's
create-only only_if_absent)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.unit.api_fakes import FakeOrchestrator, tokenizer  # noqa: F401
from omni.api import build_app
from omni.master.kv import KvStore
from omni.errors import NotFound
from omni.voices import MasterVoiceStore

pytestmark = pytest.mark.anyio


def test_kv_put_only_if_absent_creates_once():
    kv = KvStore()
    assert kv.put("voices", "a", b"1", only_if_absent=True) is True
    assert kv.put("voices", "a", b"2", only_if_absent=True) is False and kv.get("voices", "a") == b"1"
    assert kv.delete("voices", "a") and kv.put("voices", "a", b"3", only_if_absent=True) is True


def test_kv_put_only_if_absent_over_grpc():
    from omni.master.client import AsyncMasterClient, MasterClient
    from omni.master.configdiff import hash_config
    from omni.master.server import MasterServer

    cfg = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}]}
    server = MasterServer(cfg, hash_config(cfg))
    server.start()
    try:
        client = MasterClient(server.address)
        assert client.kv_put("voices", "v", b"1", only_if_absent=True) is True
        assert client.kv_put("voices", "v", b"2", only_if_absent=True) is False
        client.close()

        async def via_asyncio():
            ac = AsyncMasterClient(server.address)
            try:
                return await ac.kv_put("voices", "v", b"3", only_if_absent=True), await ac.kv_get("voices", "v")
            finally:
                await ac.close()

        assert asyncio.run(via_asyncio()) == (False, b"1")
    finally:
        server.stop(grace=0.2)


class FakeMaster:
    """AsyncMasterClient over the master's KvStore; each call yields once, as a round trip does."""

    def __init__(self):
        self.kv = KvStore()

    async def kv_put(self, ns, k, v, only_if_exists=False, only_if_absent=False):
        await asyncio.sleep(0.001)
        return self.kv.put(ns, k, v, only_if_exists, only_if_absent)

    async def kv_get(self, ns, k):
        await asyncio.sleep(0.001)
        return self.kv.get(ns, k)

    async def kv_list(self, ns, prefix=""):
        await asyncio.sleep(0.001)
        return self.kv.list(ns, prefix)[0]


async def test_two_frontends_creating_one_voice(tokenizer):  # noqa: F811
    master = FakeMaster()
    apps = [build_app(FakeOrchestrator(tokenizer), tokenizer, served_model_name="tiny", max_model_len=128,
                      speech_entry_stage=1, voices=MasterVoiceStore(master), frontend_index=i) for i in (0, 1)]
    cs = [httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://t") for a in apps]
    r0, r1 = await asyncio.gather(cs[0].post("/v1/audio/voices", json={"name": "alice", "speed": 0.5}),
                                  cs[1].post("/v1/audio/voices", json={"name": "alice", "speed": 2.0}))
    assert sorted([r0.status_code, r1.status_code]) == [201, 409]
    won = r0 if r0.status_code == 201 else r1
    stored = [v for v in (await cs[0].get("/v1/audio/voices")).json()["data"] if v["name"] == "alice"]
    assert stored == [won.json()]


async def test_a_name_no_voice_can_have_is_not_found_not_the_kv_message(tokenizer):  # noqa: F811
    """DELETE of a name over the KV's 1024-character keys answered the master's own 400 'bad kv key in
    namespace 'voices''; voice names are 1-64 characters, so such a name is a 404 like any unknown one."""
    from omni.master.client import AsyncMasterClient
    from omni.master.configdiff import hash_config
    from omni.master.server import MasterServer

    cfg = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}]}
    server = MasterServer(cfg, hash_config(cfg))
    server.start()
    master = AsyncMasterClient(server.address)
    try:
        app = build_app(FakeOrchestrator(tokenizer), tokenizer, served_model_name="tiny", max_model_len=128,
                        speech_entry_stage=1, voices=MasterVoiceStore(master))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            for name in ("x" * 2000, "x" * 65, "a b", "nobody"):
                r = await c.delete(f"/v1/audio/voices/{name}")
                assert r.status_code == 404, (len(name), r.text[:200])
                assert r.json()["error"]["type"] == "not_found_error" and "kv" not in r.text
            with pytest.raises(NotFound):
                await MasterVoiceStore(master).get("x" * 2000)
    finally:
        await master.close()
        server.stop(grace=0.2)
