"""`Authorization: bearer KEY` opens /v1 as `Bearer KEY` does: an auth scheme is case-insensitive (RFC 9110
section 11.1) and vLLM lower-cases it; the literal header `Bearer KEY` was hashed, so any other case was a 401."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import anyio_backend, assert_error, chat_body, make, tokenizer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
async def test_the_bearer_scheme_is_read_in_any_case(tokenizer, scheme):
    orch, c = make(tokenizer, api_key="s3cret", control_api_key="admin")
    r = await c.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": f"{scheme} s3cret"})
    assert r.status_code == 200, r.text
    assert (await c.post("/v1/omni/sleep", json={}, headers={"Authorization": f"{scheme} admin"})).status_code == 200
    assert orch.sleeping is True


@pytest.mark.parametrize("value", ["Basic s3cret", "s3cret", "Bearer", "Bearer  s3cret", "Bearers3cret",
                                   "Bearer S3CRET", "Token s3cret", " Bearer s3cret"])
async def test_only_the_bearer_scheme_with_the_key_opens_v1(tokenizer, value):
    _, c = make(tokenizer, api_key="s3cret")
    err = assert_error(await c.get("/v1/models", headers={"Authorization": value}), 401)
    assert err["code"] == "invalid_api_key"
