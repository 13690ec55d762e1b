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


@pytest.mark.parametrize("flags, why", [
    (["--enable-force-include-usage"], "stream_options.include_usage"),
    (["--enable-prompt-tokens-details"], "no prompt_tokens_details"),
    (["--enable-request-id-headers"], "no X-Request-Id header"),
    (["--enable-server-load-tracking"], "no /load route"),
    (["--default-chat-template-kwargs", '{"enable_thinking": false}'], "per request only"),
    (["--sse-keep-alive-interval", "5"], "no keep-alive comments"),
    (["--uds", "/tmp/x.sock"], "TCP only"),
    (["--ssl-ciphers", "ALL"], "terminate TLS in a reverse proxy"),
    (["--h11-max-header-count", "64"], "its own limits on a request's head"),
    (["--tool-strict-level", "1"], "tool calling is not supported"),
    (["--trust-request-mm-kwargs"], "mm_processor_kwargs are refused"),
    (["--grpc"], "HTTP only"),
    (["--enable-tokenizer-info-endpoint"], "no /tokenizer_info route"),
    (["--enable-offline-docs"], "no /docs or /redoc pages"),
    # an EngineArgs field (vLLM's stage took it), but only vLLM's /start_profile starts the profiler
    (["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/tmp/p"}'], "no /start_profile"),
])
def test_more_frontend_flags_are_refused_as_serve_options(capsys, flags, why):
    """They were "no stage of this pipeline takes it (stage 0 ...)"."""
    code, _, err = serve(capsys, *flags)
    assert code == 2
    assert f"omni: error: {flags[0]}: vLLM's serve option, not supported: " in err and why in err, err


@pytest.mark.parametrize("flags", [["--enable-log-deltas"], ["--log-error-stack"],
                                   ["--disable-access-log-for-endpoints", "/health"]])
def test_more_logging_flags_are_named_no_ops(capsys, flags):
    code, out, err = serve(capsys, *flags)
    assert code == 0, err
    assert f"omni: {flags[0]}: ignored: " in err and json.loads(out)["engine_flags"] == {}


@pytest.mark.parametrize("flag", ["--disable-log-stats", "--aggregate-engine-logging"])
def test_engine_logging_flags_are_no_ops_where_no_stage_takes_them(capsys, flag):
    """--disable-log-stats was fatal on a pipeline without a vllm stage (SmolLM2's torch_lm, Qwen-Image, Wan)."""
    code, out, err = serve(capsys, flag)
    assert code == 0, err
    assert f"omni: {flag}: no stage of this pipeline takes it" in err and "ignored" in err


def test_vllms_cors_flags_go_to_the_frontends_not_the_stages(capsys):
    code, out, err = serve(capsys, "--allowed-origins", '["https://app.example"]', "--allowed-methods", '["POST"]',
                           "--allow-credentials")
    assert code == 0, err
    assert json.loads(out)["engine_flags"] == {}


def test_every_vllm_frontend_option_is_in_a_table():
    """vLLM's serve parser: each dest that is not an EngineArgs field is serve's own, a no-op or refused."""
    pytest.importorskip("vllm")
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from omni import vllm_serve_flags as vsf

    engine = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    theirs = {a.dest for a in make_arg_parser(FlexibleArgumentParser())._actions} - engine
    assert theirs - vsf._OWN - vsf.NO_OPS.keys() - vsf.REFUSED.keys() == set()
    assert vsf.frontend_only("sse_keep_alive_interval") and not vsf.frontend_only("max_num_seqs")


def test_a_frontend_option_missing_from_the_tables_is_refused_as_one(capsys, monkeypatch):
    """A newer vLLM's serve option: asked of vLLM's parser when no stage takes it."""
    pytest.importorskip("vllm")
    from omni import vllm_serve_flags as vsf

    monkeypatch.delitem(vsf.REFUSED, "sse_keep_alive_interval")
    code, _, err = serve(capsys, "--sse-keep-alive-interval", "5")
    assert code == 2 and "omni: error: --sse-keep-alive-interval: vLLM's serve option, not supported by omni" in err
