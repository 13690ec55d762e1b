"""vLLM's `serve` HTTP-server options (its OpenAI frontend's, not EngineArgs) on `omni serve`.

Parsed with the engine flags (omni/engine_flags.py), they would be spread over the stages and refused
as "no stage of this pipeline takes it", which is not why. `take` removes them first: those that only
tune logging (or turn off what omni never has) are named as no-ops with what omni does instead; the
rest are refused with the reason. So are EngineArgs fields that only vLLM's serving layer reads: a
vllm stage would take them and change nothing, since omni's frontend tokenizes and samples.
"""

from __future__ import annotations

import sys
from typing import Any

from omni.config_stage_checks import SERVING_ONLY_ARGS
from omni.engine_flags import namer
from omni.errors import ConfigError

_NO_REQUEST_LOG = "omni logs no requests (their counts and latencies are on /metrics)"
NO_OPS = {
    "disable_log_requests": _NO_REQUEST_LOG,
    "enable_log_requests": _NO_REQUEST_LOG,
    "max_log_len": _NO_REQUEST_LOG,
    "enable_log_outputs": _NO_REQUEST_LOG,
    "uvicorn_log_level": "omni's HTTP server logs at --log-level",
    "disable_uvicorn_access_log": "omni's HTTP server writes no access log",
    "disable_fastapi_docs": "omni serves no /docs or /redoc pages (its schema is /openapi.json)",
    "enable_log_deltas": _NO_REQUEST_LOG,
    "disable_access_log_for_endpoints": "omni's HTTP server writes no access log",
    "log_error_stack": "omni's logs follow --log-level",
}
_TLS = "omni's HTTP API speaks plain HTTP: terminate TLS in a reverse proxy in front of it"
_TOOLS = "omni parses no tool calls out of model output: tool calling is not supported"
_TEMPLATE = "omni renders chats with the model's own chat template: an override is not supported"
REFUSED = {
    **dict.fromkeys(("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "enable_ssl_refresh"), _TLS),
    **dict.fromkeys(("enable_auto_tool_choice", "tool_call_parser", "tool_parser_plugin", "tool_server",
                     "exclude_tools_when_tool_choice_none", "expand_tools_even_if_tool_choice_none"), _TOOLS),
    **dict.fromkeys(("chat_template", "chat_template_content_format", "trust_request_chat_template"), _TEMPLATE),
    "root_path": "omni serves its routes at the root: a reverse proxy that strips the prefix can put it under one",
    "response_role": "omni's chat replies always have the role assistant",
    "middleware": "omni takes no extra ASGI middleware",
    "return_tokens_as_token_ids": "omni's logprobs name tokens as text only",
    "lora_modules": "omni serves no LoRA adapters",
    "tool_strict_level": _TOOLS,
    "ssl_ciphers": _TLS,
    "enable_force_include_usage": "a stream carries usage when the request's stream_options.include_usage asks",
    "enable_prompt_tokens_details": "omni's usage has no prompt_tokens_details",
    "enable_request_id_headers": "omni sends no X-Request-Id header",
    "enable_server_load_tracking": "omni has no /load route: the load is on /metrics and in `omni status`",
    "default_chat_template_kwargs": "chat_template_kwargs are taken per request only",
    "sse_keep_alive_interval": "omni's event streams send no keep-alive comments",
    "uds": "omni's HTTP API listens on TCP only (--host, --port)",
    **dict.fromkeys(("h11_max_header_count", "h11_max_incomplete_event_size"),
                    "omni's HTTP server (Hypercorn) keeps its own limits on a request's head"),
    "trust_request_mm_kwargs": "a request's mm_processor_kwargs are refused",
    **dict.fromkeys(("grpc", "grpc_port"), "omni's API is HTTP only (its gRPC port is the master's control plane)"),
    "enable_tokenizer_info_endpoint": "omni has no /tokenizer_info route",
    "enable_offline_docs": "omni serves no /docs or /redoc pages (its schema is /openapi.json)",
    "enable_per_request_metrics": "omni's metrics are per stage and frontend on /metrics",
    **dict.fromkeys(("cohere_is_reasoning_model", "cohere_format"), "omni serves no Cohere API"),
    "anthropic_disabled_thinking_effort": "omni serves no Anthropic API",
    **dict.fromkeys(("enable_scale_out", "data_parallel_supervisor_port", "dp_supervisor_probe_interval_s",
                     "dp_supervisor_probe_timeout_s", "dp_supervisor_probe_failure_threshold"),
                    "omni scales a stage with --num-replicas and headless stages on other hosts"),
    **dict.fromkeys(("fingerprint_mode", "fingerprint_value"), "omni's responses carry no system_fingerprint"),
    "enable_flash_late_interaction": "omni serves no late-interaction (ColBERT) scoring",
    # EngineArgs fields, but only vLLM's serving layer reads them (a deploy's engine_args are refused too).
    **SERVING_ONLY_ARGS,
    "reasoning_parser": "omni does not split reasoning out of model output (it stays in the content)",
}


# EngineArgs fields that only set an engine's logging: where no stage takes them, named and ignored.
LOGGING_ONLY_ARGS = ("disable_log_stats", "aggregate_engine_logging")
_OWN = frozenset({"help", "model_tag", "headless", "api_server_count", "config", "host", "port", "api_key",
                  "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials"})   # api/cors.py


def frontend_only(key: str) -> bool:
    """Whether `key` is an option of vLLM's serve frontend (a dest of its parser, not an EngineArgs field) that
    the tables here lack: asked of the vLLM installed (a newer one's options), only when no stage takes `key`."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        try:
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
        except ImportError:
            from vllm.entrypoints.openai.cli_args import make_arg_parser
        parser = make_arg_parser(FlexibleArgumentParser())
    except Exception:   # noqa: BLE001 -- no vLLM here, or one whose parser cannot be built: the tables only
        return False
    import dataclasses

    engine = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    return any(a.dest == key for a in parser._actions) and key not in engine and key not in _OWN


def take(flags: dict[str, Any], typed: dict[str, str] | None = None) -> None:
    """Remove vLLM's frontend options from the parsed extra flags: a no-op is named on stderr, the first
    one omni lacks is refused (one line, naming it, as `typed` where given, and why)."""
    flag_name = namer(typed)
    refused = next((k for k in flags if k in REFUSED), None)
    if refused is not None:
        raise ConfigError(f"{flag_name(refused)}: vLLM's serve option, not supported: {REFUSED[refused]}")
    for key in [k for k in flags if k in NO_OPS]:
        print(f"omni: {flag_name(key)}: ignored: {NO_OPS[key]}", file=sys.stderr, flush=True)
        del flags[key]
