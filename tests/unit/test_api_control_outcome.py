"""POST /v1/omni/sleep and /v1/omni/wakeup answer by the replicas' acks: 200 when at least one acked ok,
409 naming the refusing stages when every one refused, 503 when none was there; `results` is kept."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import assert_error, make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio

CPU_REFUSAL = "QwenImage on CPU cannot sleep at level 1: its weights have no device memory to free"


def acks(*oks: bool) -> dict:
    return {"results": [{"stage_id": i, "replica_id": f"s{i}-r0", "ok": ok, "message": "ok" if ok else CPU_REFUSAL}
                        for i, ok in enumerate(oks)], "is_sleeping": False}


@pytest.mark.parametrize("path", ["/v1/omni/sleep?level=1", "/v1/omni/wakeup"])
async def test_every_replica_refusing_is_a_409_naming_them_with_the_results(tokenizer, path):  # noqa: F811
    orch, c = make(tokenizer)
    out = acks(False, False)

    async def command(*_):
        return out

    orch.sleep = orch.wake_up = command
    r = await c.post(path)
    err = assert_error(r, 409, contains="refused by every stage replica")
    assert "stage 0 (s0-r0): " + CPU_REFUSAL in err["message"] and "stage 1 (s1-r0)" in err["message"]
    assert err["type"] == "conflict_error"
    assert r.json()["results"] == out["results"] and r.json()["is_sleeping"] is False


async def test_a_partial_outcome_is_200_and_no_replica_is_503(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    outs = [acks(True, False), {"results": [], "is_sleeping": False}]

    async def sleep(level=1, mode="abort", stage_ids=()):
        return outs.pop(0)

    orch.sleep = sleep
    r = await c.post("/v1/omni/sleep")
    assert r.status_code == 200 and [x["ok"] for x in r.json()["results"]] == [True, False]
    r = await c.post("/v1/omni/sleep")
    assert_error(r, 503, contains="no live stage replica")
    assert r.json()["results"] == []


async def test_openapi_lists_the_409(tokenizer):  # noqa: F811
    _, c = make(tokenizer)
    paths = (await c.get("/openapi.json")).json()["paths"]
    assert "409" in paths["/v1/omni/sleep"]["post"]["responses"]
    assert "409" in paths["/v1/omni/wakeup"]["post"]["responses"]


async def test_a_wait_that_ends_with_a_frontend_still_busy_is_a_409_with_the_frontends_acks(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    frontends = [{"replica_id": "fe0", "ok": True, "message": "no request in flight"},
                 {"replica_id": "fe1", "ok": False, "message": "1 request(s) still in flight after 305 s"}]

    async def sleep(level=1, mode="abort", stage_ids=()):
        return {"results": [], "frontends": frontends, "is_sleeping": False}

    orch.sleep = sleep
    r = await c.post("/v1/omni/sleep?mode=wait")
    err = assert_error(r, 409, contains="nothing was put to sleep: fe1: 1 request(s) still in flight after 305 s")
    assert err["code"] == "sleep_busy" and r.json()["frontends"] == frontends and r.json()["results"] == []


async def test_openapi_lists_the_sleep_routes_query_parameters(tokenizer):  # noqa: F811
    """vLLM's paths with its query parameters, vllm-omni's with its JSON body; stage_ids capped at the last stage."""
    _, c = make(tokenizer)
    spec = (await c.get("/openapi.json")).json()
    paths, schemas = spec["paths"], spec["components"]["schemas"]
    assert {p["name"] for p in paths["/sleep"]["post"]["parameters"]} == {"level", "mode", "stage_ids"}
    assert [p["name"] for p in paths["/wake_up"]["post"]["parameters"]] == ["stage_ids"]
    assert "requestBody" not in paths["/sleep"]["post"]
    for path in ("/v1/omni/sleep", "/v1/omni/wakeup"):
        assert "parameters" not in paths[path]["post"] and paths[path]["post"]["requestBody"]["required"] is False
    assert {"level", "mode", "stage_ids"} == set(schemas["SleepRequest"]["properties"])


async def test_a_wait_that_could_not_reach_a_frontend_is_a_503_naming_it(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    frontends = [{"replica_id": "fe1", "ok": False, "outcome": "disconnected",
                  "message": "no keep-alive stream (the replica is SUSPECT)"}]

    async def sleep(level=1, mode="abort", stage_ids=()):
        return {"results": [], "frontends": frontends, "is_sleeping": False}

    orch.sleep = sleep
    r = await c.post("/sleep?mode=wait")
    err = assert_error(r, 503, contains="a frontend cannot be reached: fe1: no keep-alive stream")
    assert err["code"] == "frontend_unreachable" and r.json()["frontends"] == frontends


@pytest.mark.parametrize("path", ["/v1/omni/sleep", "/sleep", "/v1/omni/wakeup", "/wake_up"])
async def test_vllm_omnis_status_and_acks_are_beside_the_results(tokenizer, path):  # noqa: F811
    """vllm-omni's server answers {"status": "SUCCESS", "acks": [OmniACK...]}: a client of it reads those."""
    orch, c = make(tokenizer)

    async def command(*_, **__):
        return acks(True, False)

    orch.sleep = orch.wake_up = command
    r = await c.post(path)
    assert r.status_code == 200 and r.json()["status"] == "SUCCESS"
    assert r.json()["acks"] == [
        {"status": "SUCCESS", "stage_id": 0, "replica_id": "s0-r0", "error_msg": None},
        {"status": "ERROR", "stage_id": 1, "replica_id": "s1-r0", "error_msg": CPU_REFUSAL}]
    assert r.json()["results"] == acks(True, False)["results"] and r.json()["is_sleeping"] is False


async def test_every_refusal_is_status_error_with_the_error_body_kept(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    busy = [{"replica_id": "fe1", "ok": False, "message": "1 request(s) still in flight after 305 s"}]
    outs = [acks(False), {"results": [], "is_sleeping": False},
            {"results": [], "frontends": busy, "is_sleeping": False}]

    async def sleep(level=1, mode="abort", stage_ids=()):
        return outs.pop(0)

    orch.sleep = sleep
    answers = []
    for status, code in ((409, "sleep_refused"), (503, None), (409, "sleep_busy")):
        r = await c.post("/v1/omni/sleep?mode=wait")
        err = assert_error(r, status)
        assert err["code"] == code and r.json()["status"] == "ERROR"
        answers.append(r.json())
    assert answers[0]["acks"] == [{"status": "ERROR", "stage_id": 0, "replica_id": "s0-r0", "error_msg": CPU_REFUSAL}]
    assert answers[1]["acks"] == answers[2]["acks"] == [] and answers[2]["frontends"] == busy
