"""Sleep's level from the query string (as vLLM's POST /sleep takes it), and parameters omni does not
take on sleep and on voice creation are refused by name, never ignored."""

from __future__ import annotations

import pytest

from omni.api import InMemoryVoiceStore
from tests.unit.api_fakes import assert_error, make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


async def test_sleep_takes_the_level_from_the_query_string(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    levels, modes = [], []
    real = orch.sleep

    async def sleep(level=1, mode="abort", stage_ids=()):
        levels.append(level)
        modes.append(mode)
        return await real(level, mode, stage_ids)

    orch.sleep = sleep
    assert (await c.post("/v1/omni/sleep?level=1")).status_code == 200
    assert (await c.post("/v1/omni/sleep", json={"level": 1})).status_code == 200
    # No level: vllm-omni's default (2) on its route, vLLM's (1) on vLLM's
    assert (await c.post("/v1/omni/sleep")).status_code == 200
    assert (await c.post("/sleep")).status_code == 200
    assert (await c.post("/v1/omni/sleep?level=2", json={})).status_code == 200   # an empty body names no level
    assert levels == [1, 1, 2, 1, 2]
    assert_error(await c.post("/v1/omni/sleep?level=7"), 400, "level")
    assert_error(await c.post("/sleep?level=0"), 400, "level", contains="vLLM's level 0 pauses scheduling alone")
    assert_error(await c.post("/v1/omni/sleep?level=deep"), 400, "level")
    assert_error(await c.post("/v1/omni/sleep?level=%D9%A1"), 400, "level")   # Arabic-Indic one: int() read it as 1
    assert_error(await c.post("/v1/omni/sleep?level=" + "1" * 5000), 400, "level")   # int() raised: a 500
    assert_error(await c.post("/v1/omni/sleep?level=2", json={"level": 1}), 400, "level")
    assert_error(await c.post("/v1/omni/sleep?lvl=2"), 400, "lvl")
    assert levels == [1, 1, 2, 1, 2] and modes == ["abort"] * 5


async def test_sleep_and_wakeup_take_vllm_omnis_stage_ids(tokenizer):  # noqa: F811
    """vllm-omni's documented requests: {"stage_ids": [0], "level": 2} to /v1/omni/sleep, {"stage_ids": [0, 1]}
    to /v1/omni/wakeup; its /sleep takes ?stage_ids= too."""
    orch, c = make(tokenizer)
    r = await c.post("/v1/omni/sleep", json={"stage_ids": [0], "level": 2})
    assert r.status_code == 200 and r.json()["stage_ids"] == [0] and r.json()["level"] == 2, r.text
    r = await c.post("/sleep?level=1&stage_ids=1&stage_ids=2")
    assert r.status_code == 200 and r.json()["stage_ids"] == [1, 2], r.text
    r = await c.post("/v1/omni/wakeup", json={"stage_ids": [0, 1]})
    assert r.status_code == 200 and r.json()["stage_ids"] == [0, 1], r.text
    r = await c.post("/wake_up?stage_ids=3")
    assert r.status_code == 200 and r.json()["stage_ids"] == [3], r.text
    assert (await c.post("/v1/omni/wakeup")).json()["stage_ids"] == []
    for bad in ({"stage_ids": []}, {"stage_ids": [-1]}, {"stage_ids": "0"}):
        assert_error(await c.post("/v1/omni/sleep", json=bad), 400)
        assert_error(await c.post("/v1/omni/wakeup", json=bad), 400)
    assert_error(await c.post("/sleep?stage_ids=x"), 400, "stage_ids")
    assert_error(await c.post("/sleep?stage_ids=0", json={"stage_ids": [0]}), 400, "stage_ids")
    assert_error(await c.post("/v1/omni/wakeup", json={"stage_ids": [0], "tags": ["weights"]}), 400, "tags")
    assert_error(await c.post("/v1/omni/wakeup", json={"level": 1}), 400, "level")


async def test_sleep_takes_vllms_mode_and_refuses_keep_by_name(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    modes = []
    real = orch.sleep

    async def sleep(level=1, mode="abort", stage_ids=()):
        modes.append(mode)
        return await real(level, mode, stage_ids)

    orch.sleep = sleep
    assert (await c.post("/v1/omni/sleep?mode=wait")).status_code == 200
    assert (await c.post("/v1/omni/sleep?level=2&mode=abort")).status_code == 200
    assert (await c.post("/v1/omni/sleep", json={"level": 2, "mode": "wait"})).status_code == 200
    assert (await c.post("/v1/omni/sleep?mode=wait", json={"mode": "wait"})).status_code == 200
    assert modes == ["wait", "abort", "wait", "wait"]
    # vLLM's keep holds requests across a sleep: omni's stages drop their KV caches, so it is refused by name.
    assert_error(await c.post("/v1/omni/sleep?mode=keep"), 400, "mode", contains="mode=keep is not supported")
    assert_error(await c.post("/v1/omni/sleep", json={"mode": "keep"}), 400, "mode")
    assert_error(await c.post("/v1/omni/sleep?mode=later"), 400, "mode")
    assert_error(await c.post("/v1/omni/sleep", json={"mode": "later"}), 400, "mode")
    assert_error(await c.post("/v1/omni/sleep?mode=wait", json={"mode": "abort"}), 400, "mode")
    assert modes == ["wait", "abort", "wait", "wait"]


async def test_wakeup_refuses_vllms_tags_and_any_other_parameter_by_name(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    orch.sleeping = True
    assert_error(await c.post("/v1/omni/wakeup?tags=kv_cache"), 400, "tags", "wakes every stage whole")
    assert_error(await c.post("/v1/omni/wakeup", json={"tags": ["weights"], "bogus": 1}), 400, "tags")
    assert_error(await c.post("/v1/omni/wakeup", json={"bogus": 1}), 400, "bogus")
    assert_error(await c.post("/v1/omni/wakeup?level=1"), 400, "level")
    assert orch.sleeping     # nothing woke
    assert (await c.post("/v1/omni/wakeup", json={})).status_code == 200 and not orch.sleeping
    assert (await c.post("/v1/omni/wakeup")).status_code == 200


async def test_a_voice_with_an_unknown_field_is_refused(tokenizer):  # noqa: F811
    _, c = make(tokenizer, speech_entry_stage=1, voices=InMemoryVoiceStore(("joe",)))
    assert_error(await c.post("/v1/audio/voices", json={"name": "amy", "sped": 2.0}), 400, "sped")
    assert_error(await c.post("/v1/audio/voices", json={"name": "amy", "ref_audio": "data:,"}), 400, "ref_audio")
    assert [v["name"] for v in (await c.get("/v1/audio/voices")).json()["data"]] == ["joe"]
