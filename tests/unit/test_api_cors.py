"""vLLM's CORS flags (omni/api/cors.py): off by default (no origin answered); with --allowed-origins the
frontend answers CORS as vLLM's server does and lets those origins past the cross-site check. They were
refused: a browser app of another origin could not use a keyless omni at all."""

from __future__ import annotations

import pytest

from omni.api.cors import take
from omni.api.limits import HttpLimits
from omni.errors import ConfigError
from tests.unit.api_fakes import assert_error, chat_body, make, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio
APP = "https://app.example"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


async def test_without_allowed_origins_no_origin_is_answered(tokenizer):  # noqa: F811
    _, c = make(tokenizer)
    r = await c.post("/v1/chat/completions", json=chat_body(), headers={"Origin": APP})
    assert_error(r, 403, param="Origin")
    r = await c.options("/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers


async def test_allowed_origins_answer_the_preflight_and_the_request_as_vllm(tokenizer):  # noqa: F811
    limits = HttpLimits(allowed_origins=(APP,))
    _, c = make(tokenizer, limits=limits, api_key="k1")
    r = await c.options("/v1/chat/completions", headers=PREFLIGHT)     # no key on a preflight
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    r = await c.post("/v1/chat/completions", json=chat_body(), headers={"Origin": APP, "Authorization": "Bearer k1"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    r = await c.post("/v1/chat/completions", json=chat_body(), headers={"Origin": APP})
    assert r.status_code == 401                                          # the key still guards /v1


async def test_a_keyless_server_lets_its_allowed_origins_write_and_no_other(tokenizer):  # noqa: F811
    orch, c = make(tokenizer, limits=HttpLimits(allowed_origins=(APP,)))
    assert (await c.post("/v1/omni/sleep", headers={"Origin": APP})).status_code == 200
    assert_error(await c.post("/v1/omni/wakeup", headers={"Origin": "https://evil.example"}), 403, param="Origin")
    _, c = make(tokenizer, limits=HttpLimits(allowed_origins=("*",)))
    r = await c.post("/v1/chat/completions", json=chat_body(), headers={"Origin": "https://any.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_the_flags_are_taken_as_vllm_spells_them_and_checked():
    flags = {"allowed_origins": [APP], "allow_credentials": True, "max_num_seqs": 2}
    assert take(flags, headless=False) == {"allowed_origins": (APP,), "allow_credentials": True}
    assert flags == {"max_num_seqs": 2}
    assert take({"allowed_origins": APP}, headless=False) == {"allowed_origins": (APP,)}
    assert take({}, headless=False) == {}
    with pytest.raises(ConfigError, match=r"--allowed-methods: needs --allowed-origins"):
        take({"allowed_methods": ["GET"]}, headless=False)
    with pytest.raises(ConfigError, match=r"--allowed-origins takes a JSON list of 1-64 non-empty strings"):
        take({"allowed_origins": [1]}, headless=False)
    with pytest.raises(ConfigError, match=r"--allowed-origins: not with --headless"):
        take({"allowed_origins": [APP]}, headless=True)
    limits = HttpLimits(allowed_origins=(APP,), allowed_methods=("GET", "POST"))
    assert HttpLimits.from_dict(limits.to_dict()) == limits        # as the launcher hands it to a frontend
