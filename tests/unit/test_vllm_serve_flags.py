"""vLLM's serve HTTP-server flags on `omni serve`: logging-only ones are named no-ops, the rest are
refused with the real reason (they were "no stage of this pipeline takes it")."""

from __future__ import annotations

import json

import pytest

from omni.cli import main


def serve(capsys, *flags: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", *flags, "--dry-run"])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("flags, why", [
    (["--disable-log-requests"], "omni logs no requests"),
    (["--enable-log-requests"], "omni logs no requests"),
    (["--uvicorn-log-level", "debug"], "logs at --log-level"),
    (["--disable-uvicorn-access-log"], "writes no access log"),
    (["--disable-fastapi-docs"], "no /docs or /redoc pages"),
])
def test_logging_flags_are_named_no_ops(capsys, flags, why):
    code, out, err = serve(capsys, *flags)
    assert code == 0, err
    assert f"omni: {flags[0]}: ignored: " in err and why in err, err
    assert json.loads(out)["engine_flags"] == {}


@pytest.mark.parametrize("flags, why", [
    (["--ssl-keyfile", "k.pem"], "plain HTTP: terminate TLS in a reverse proxy"),
    (["--ssl-certfile", "c.pem"], "plain HTTP: terminate TLS in a reverse proxy"),
    (["--allowed-origins", '["*"]'], "no CORS headers"),
    (["--allowed-methods", '["*"]'], "no CORS headers"),
    (["--allowed-headers", '["*"]'], "no CORS headers"),
    (["--enable-auto-tool-choice"], "tool calling is not supported"),
    (["--tool-call-parser", "hermes"], "tool calling is not supported"),
    (["--chat-template", "t.jinja"], "model's own chat template: an override is not supported"),
    (["--root-path", "/api"], "serves its routes at the root"),
    (["--response-role", "bot"], "always have the role assistant"),
    (["--middleware", "m.M"], "no extra ASGI middleware"),
    (["--return-tokens-as-token-ids"], "name tokens as text only"),
    (["--tokenizer", "other/tok"], "tokenizes with MODEL's own tokenizer"),
    (["--revision", "main"], "loads MODEL as it is on disk"),
    (["--generation-config", "vllm"], "default_sampling_params in the deploy YAML"),
    (["--reasoning-parser", "deepseek_r1"], "does not split reasoning out"),
])
def test_frontend_flags_omni_lacks_are_refused_with_the_reason(capsys, flags, why):
    code, _, err = serve(capsys, *flags)
    assert code == 2
    assert f"omni: error: {flags[0]}: vLLM's serve option, not supported: " in err and why in err, err
    assert "no stage of this pipeline takes it" not in err
