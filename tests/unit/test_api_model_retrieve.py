"""GET /v1/models/{model} (OpenAI's client.models.retrieve): the card /v1/models lists for that name, a
served name or an alias, names with a slash included; OpenAI's model_not_found 404 for any other; keyed as
/v1/models."""

from __future__ import annotations

import pytest

from omni.api.routes import label
from tests.unit.api_fakes import assert_error, make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio

NAME = "Qwen/Qwen3-Omni-30B-A3B-Instruct"


async def test_each_listed_name_is_retrieved_as_listed(tokenizer):  # noqa: F811
    _, c = make(tokenizer, served_model_name=[NAME, "b"], model_aliases=["alias"], model_path="/models/q3")
    listed = (await c.get("/v1/models")).json()["data"]
    assert [m["id"] for m in listed] == [NAME, "b", "alias"]
    for card in listed:
        r = await c.get(f"/v1/models/{card['id']}")
        assert r.status_code == 200, r.text
        assert r.json() == card


async def test_an_unknown_name_is_openais_model_not_found(tokenizer):  # noqa: F811
    _, c = make(tokenizer)
    for path in ("/v1/models/gpt-4o", "/v1/models/Qwen/other"):
        err = assert_error(await c.get(path), 404, "model", "does not exist")
        assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"


async def test_it_takes_the_api_key_as_the_list_does(tokenizer):  # noqa: F811
    _, c = make(tokenizer, api_key="k")
    assert_error(await c.get("/v1/models/tiny"), 401)
    r = await c.get("/v1/models/tiny", headers={"authorization": "Bearer k"})
    assert r.status_code == 200 and r.json()["id"] == "tiny"


async def test_openapi_and_metrics_name_the_template(tokenizer):  # noqa: F811
    _, c = make(tokenizer)
    op = (await c.get("/openapi.json")).json()["paths"]["/v1/models/{model}"]["get"]
    assert [p["name"] for p in op["parameters"]] == ["model"] and "404" in op["responses"]
    assert label(f"/v1/models/{NAME}") == "/v1/models/{model}"
