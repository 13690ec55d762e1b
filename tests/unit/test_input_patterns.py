"""Names and ids a client sends are checked whole: Python's `$` (re.match, and msgspec's patterns, which it
checks with re.search) also matches before a final newline, so "joe\\n" passed the voice name rule and was
stored beside the built-in joe, and "abc\\n" passed request_id's printable-ASCII rule."""

from __future__ import annotations

import pytest

from omni.api import InMemoryVoiceStore
from omni.api.job_store import LocalKv
from omni.errors import NotFound
from omni.master.kv import KvError, KvStore
from omni.voices import MasterVoiceStore
from tests.unit.api_fakes import assert_error, chat_body, make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


async def test_a_voice_name_with_a_trailing_newline_is_refused(tokenizer):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1, voices=InMemoryVoiceStore(("joe",)))
    for name in ("joe\n", "slow-joe\n"):
        assert_error(await c.post("/v1/audio/voices", json={"name": name}), 400, "name")
    assert [v["name"] for v in (await c.get("/v1/audio/voices")).json()["data"]] == ["joe"]


class AskedKv:
    """A master whose KV records what it is asked (and holds nothing)."""

    def __init__(self):
        self.asked = []

    async def kv_get(self, ns, key):
        self.asked.append(key)

    async def kv_delete(self, ns, key):
        self.asked.append(key)
        return False


async def test_the_voice_store_looks_up_no_name_with_a_trailing_newline():
    master = AskedKv()
    with pytest.raises(NotFound):
        await MasterVoiceStore(master).get("amy\n")
    with pytest.raises(NotFound):
        await MasterVoiceStore(master).delete("amy\n")
    assert master.asked == []


@pytest.mark.parametrize("field,value", [("request_id", "trace-42\n"), ("logit_bias", {"5\n": 1.0})])
async def test_a_request_field_with_a_trailing_newline_is_refused_by_name(tokenizer, field, value):  # noqa: F811
    orch, c = make(tokenizer)
    assert_error(await c.post("/v1/chat/completions", json=chat_body(**{field: value})), 400, field)
    assert_error(await c.post("/v1/completions", json={"prompt": "hi", field: value}), 400, field)
    assert orch.requests == []


def test_a_kv_namespace_with_a_trailing_newline_is_refused():
    # the master persists a namespace under its name: "voices\n" would be a second one beside voices
    with pytest.raises(KvError, match="bad kv namespace"):
        KvStore().put("voices\n", "k", b"")


async def test_a_job_id_with_a_trailing_newline_is_not_looked_up(tokenizer, tmp_path):  # noqa: F811
    from omni.api.job_store import Results
    from omni.api.jobs import Jobs

    class Kv(LocalKv):
        asked = []

        async def kv_get(self, namespace, key):
            self.asked.append(key)
            return await super().kv_get(namespace, key)

    kv = Kv()
    orch, c = make(tokenizer, speech_entry_stage=1, jobs=Jobs(kv, Results(tmp_path)))
    assert_error(await c.get("/v1/omni/jobs/job-" + "0" * 32 + "%0A"), 404, "job_id")
    assert kv.asked == []
