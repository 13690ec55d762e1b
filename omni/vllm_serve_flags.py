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
from omni.engine_flags import flag_name
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
}
_TLS = "omni's HTTP API speaks plain HTTP: terminate TLS in a reverse proxy in front of it"
_CORS = "omni sends no CORS headers: a browser client needs a reverse proxy that adds them"
_TOOLS = "omni parses no tool calls out of model output: tool calling is not supported"
_TEMPLATE = "omni renders chats with the model's own chat template: an override is not supported"
REFUSED = {
    **dict.fromkeys(("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "enable_ssl_refresh"), _TLS),
    **dict.fromkeys(("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials"), _CORS),
    **dict.fromkeys(("enable_auto_tool_choice", "tool_call_parser", "tool_parser_plugin", "tool_server",
                     "exclude_tools_when_tool_choice_none", "expand_tools_even_if_tool_choice_none"), _TOOLS),
    **dict.fromkeys(("chat_template", "chat_template_content_format", "trust_request_chat_template"), _TEMPLATE),
    "root_path": "omni serves its routes at the root: a reverse proxy that strips the prefix can put it under one",
    "response_role": "omni's chat replies always have the role assistant",
    "middleware": "omni takes no extra ASGI middleware",
    "return_tokens_as_token_ids": "omni's logprobs name tokens as text only",
    "lora_modules": "omni serves no LoRA adapters",
    # EngineArgs fields, but only vLLM's serving layer reads them (a deploy's engine_args are refused too).
    **SERVING_ONLY_ARGS,
    "reasoning_parser": "omni does not split reasoning out of model output (it stays in the content)",
}


def take(flags: dict[str, Any]) -> None:
    """Remove vLLM's frontend options from the parsed extra flags: a no-op is named on stderr, the first
    one omni lacks is refused (one line, naming it and why)."""
    refused = next((k for k in flags if k in REFUSED), None)
    if refused is not None:
        raise ConfigError(f"{flag_name(refused)}: vLLM's serve option, not supported: {REFUSED[refused]}")
    for key in [k for k in flags if k in NO_OPS]:
        print(f"omni: {flag_name(key)}: ignored: {NO_OPS[key]}", file=sys.stderr, flush=True)
        del flags[key]
