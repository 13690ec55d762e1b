"""GET /v1/models reports the context as it is now: orchestrator/limits.follow_limits sets max_model_len
from the prompt stage's replicas as they register, after the app was built."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


async def test_models_follow_max_model_len(tokenizer):  # noqa: F811
    _, c = make(tokenizer, model_aliases=["b"])
    fe = c._transport.app.state.frontend
    assert {m["max_model_len"] for m in (await c.get("/v1/models")).json()["data"]} == {128}
    fe.max_model_len = 4096          # the replicas registered a longer context
    for req in (c.build_request("GET", "/v1/models"),                       # the probe's fast path
                c.build_request("GET", "/v1/models", content=b"{}",          # through the route
                                headers={"content-type": "application/json"})):
        d = (await c.send(req)).json()
        assert [m["id"] for m in d["data"]] == ["tiny", "b"]
        assert {m["max_model_len"] for m in d["data"]} == {4096}
    assert (await c.post("/tokenize", json={"prompt": "hi"})).json()["max_model_len"] == 4096


async def test_models_with_an_api_key_follow_it_too(tokenizer):  # noqa: F811
    _, c = make(tokenizer, api_key="k")
    c._transport.app.state.frontend.max_model_len = 2048
    r = await c.get("/v1/models", headers={"Authorization": "Bearer k"})
    assert r.json()["data"][0]["max_model_len"] == 2048
