"""The `omni` command line (typer): serve, master, status."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
from typing import Any, List, Optional

import typer

from omni import cli_argv, envs, serve_argv
from omni.cli_argv import SECRET_FLAGS, hide_secrets, mask_in_message, spread_several_values  # noqa: F401 (omni.cli's API)
from omni.errors import ConfigError, OmniError

app = typer.Typer(
    name="omni",
    help="omni: a Ray-free distributed stage runtime for multi-stage model serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Flags that take JSON and also accept vLLM's dotted form: --stage-overrides.1.max_model_len 1024
JSON_FLAGS = ("--stage-overrides", "--engine-args")


def _scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# vllm-omni's short forms, spelled out before parsing (as options they would crowd the long names
# out of --help's column).
SHORT_FLAGS = {"-oma": "--omni-master-address", "-omp": "--omni-master-port", "-ora": "--omni-replica-address",
               "-dac": "--diffusion-attention-config"}


def fold_dotted_args(argv: list[str], flags: tuple[str, ...] = JSON_FLAGS) -> list[str]:
    """Turn `--x '{"a":1}' --x.b.c 2` into one `--x '{"a":1,"b":{"c":2}}'`."""
    merged: dict[str, dict] = {}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        base = next((f for f in flags if name == f or name.startswith(f + ".")), None)
        if base is None:
            out.append(arg)
            i += 1
            continue
        if eq:
            value = inline
        elif i + 1 < len(argv):
            value = argv[i + 1]
            i += 1
        else:
            raise ConfigError(f"{name}: expected a value")
        i += 1
        target = merged.setdefault(base, {})
        if name == base:
            try:
                obj = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{base}: not valid JSON ({e.msg} at column {e.colno}): {value!r}") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{base}: expected a JSON object, got {type(obj).__name__}")
            cli_argv.merge_into(target, obj)
        else:
            keys = name[len(base) + 1:].split(".")
            if not all(keys):
                raise ConfigError(f"{name}: empty key in dotted flag")
            node = target
            for k in keys[:-1]:
                node = node.setdefault(k, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{name}: {k} is not an object")
            node[keys[-1]] = _scalar(value)
    for base, obj in merged.items():
        out += [base, json.dumps(obj)]
    return out


def _json_flag(name: str, value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name}: not valid JSON ({e.msg} at column {e.colno}): {value!r}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{name}: expected a JSON object, got {type(obj).__name__}")
    return obj


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)} (any case), got {value!r}")
    return value.upper()


def _api_keys(given: list[str] | None) -> list[str]:
    """vLLM's way: the --api-key values (any one is accepted), else ONE key from the environment,
    OMNI_API_KEY before vLLM's VLLM_API_KEY (a key there may hold spaces: it is not split)."""
    if given:
        if "" in given:
            _refuse_empty_key("--api-key", "OMNI_API_KEY", "")
        return list(dict.fromkeys(given))
    # An empty one is refused, not passed over: OMNI_API_KEY= set with a VLLM_API_KEY is still a mistake.
    env = "OMNI_API_KEY" if "OMNI_API_KEY" in os.environ else "VLLM_API_KEY"
    _refuse_empty_key("--api-key", env, None)
    key = os.environ.get(env)
    return [key] if key else []


def _served_names(given: list[str] | None) -> list[str]:
    if given and "" in given:
        raise ConfigError("--served-model-name: a name is empty")
    return list(dict.fromkeys(given or ()))


def _refuse_empty_key(flag: str, env: str, value: str | None, what: str = "a key") -> None:
    # An empty key would mean "no auth": fail closed, as a mistyped secret is the likely cause.
    # (click reads an empty environment variable as unset: the environment is looked at here.)
    if value == "" or (value is None and os.environ.get(env) == ""):
        source = flag if value == "" else f"{env} (the environment's {flag})"
        raise ConfigError(f"{source} is empty; give {what}, or leave it unset for no auth")


def refuse_empty_token(value: str | None) -> None:
    """An empty --omni-token / OMNI_TOKEN would turn the master's and the data plane's auth off."""
    _refuse_empty_key("--omni-token", "OMNI_TOKEN", value, what="a token")


def _token_checked(command):
    """`command` (one taking omni_token) refusing an empty token by name before it runs."""
    @functools.wraps(command)   # typer reads the options from the wrapped signature
    def run(*args, **kwargs):
        refuse_empty_token(kwargs.get("omni_token"))
        return command(*args, **kwargs)
    return run


@app.command(context_settings={"help_option_names": ["-h", "--help"], "allow_extra_args": True,
                                "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: Optional[str] = typer.Argument(None, metavar="MODEL", help="Model id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct) or a local folder; also --model MODEL, or model: in vLLM's --config FILE.yaml (a YAML of flags; the command line wins)."),
    deploy_config: Optional[str] = typer.Option(None, "--deploy-config", help="Deploy YAML to use instead of the bundled one for MODEL."),
    stage_configs_path: Optional[str] = typer.Option(None, "--stage-configs-path", help="vllm-omni's legacy stage config YAML (stage_args), read as a deploy overlay on MODEL's pipeline."),
    stage_overrides: Optional[str] = typer.Option(None, "--stage-overrides", help='JSON patch per stage, e.g. \'{"0": {"max_model_len": 1024}}\' (also --stage-overrides.0.max_model_len 1024). Single-command mode.'),
    stage_id: Optional[int] = typer.Option(None, "--stage-id", help="Run only this stage (stage mode). 0 is the head: master + orchestrator + HTTP."),
    headless: bool = typer.Option(False, "--headless", help="Run the stage given by --stage-id without HTTP; connects to the master."),
    omni_master_address: Optional[str] = typer.Option(None, "--omni-master-address", help="Address of the omni master (the head hosts it; hosting it beyond loopback: needs --omni-token)."),
    omni_master_port: Optional[int] = typer.Option(None, "--omni-master-port", help="Port of the omni master."),
    omni_token: Optional[str] = typer.Option(None, "--omni-token", envvar="OMNI_TOKEN", help="Shared token for the master and the data plane."),
    omni_replica_address: Optional[str] = typer.Option(None, "--omni-replica-address", help="Address this replica advertises to peers and binds its listeners on (default: the local address that routes to the master; beyond loopback: needs --omni-token)."),
    tls_cert: Optional[str] = typer.Option(None, "--tls-cert", help="PEM certificate of the omni master (gRPC) run here: TLS, its address a name in the certificate. With --headless: the client certificate shown to an mTLS master. (vLLM's --ssl-* are for HTTP, which omni serves plain: refused.)"),
    tls_key: Optional[str] = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert (a path; each process reads the file)."),
    tls_ca: Optional[str] = typer.Option(None, "--tls-ca", help="PEM CA that verifies the master (enables TLS with --headless). Where the master runs here: it also requires client certificates signed by it (mTLS); this host's processes present --tls-cert, which then needs serverAuth and clientAuth usage."),
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP listen address."),
    port: int = typer.Option(8091, "--port", help="HTTP port; 0 picks a free one (printed)."),
    api_server_count: int = typer.Option(1, "--api-server-count", help="Number of API frontend processes sharing the stage engines."),
    api_keys: Optional[List[str]] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1 routes; takes several keys (--api-key K1 K2), any one of them is accepted. Unset: one key from env OMNI_API_KEY, else vLLM's VLLM_API_KEY."),  # noqa: B008 (typer's list option)
    control_api_key: Optional[str] = typer.Option(None, "--control-api-key", envvar="OMNI_CONTROL_API_KEY", help="Require 'Authorization: Bearer KEY' with this key (not --api-key) on the control routes /v1/omni/sleep and /v1/omni/wakeup."),
    disable_control_routes: bool = typer.Option(False, "--disable-control-routes", help="Answer 403 on /v1/omni/sleep and /v1/omni/wakeup (the master's `omni sleep`/`omni wakeup` still work)."),
    allowed_hosts: Optional[List[str]] = typer.Option(None, "--allowed-hosts", help="Without --api-key, a request that arrives on a loopback address answers only a Host that is localhost, an IP, this host's name, an /etc/hosts loopback name or one of these: a page on a domain re-pointed at 127.0.0.1 (DNS rebinding) gets a 403. For a proxy on this host that forwards its public Host. Takes several (--allowed-hosts a.example .b.example); .b.example or *.b.example takes the subdomains too, '*' any name."),  # noqa: B008 (typer's list option)
    served_model_names: Optional[List[str]] = typer.Option(None, "--served-model-name", help="Model name(s) the API answers to; takes several (--served-model-name A B), the first is the one it reports (default: MODEL). MODEL and the deploy's aliases are answered to as well."),  # noqa: B008 (typer's list option)
    num_replicas: Optional[int] = typer.Option(None, "--num-replicas", help="Replicas of the stage(s) run here (no --stage-id: of every stage). 0 with --stage-id 0 (the head): only the master and the HTTP frontends run here; stage 0 runs headless on other hosts."),
    omni_dp_size_local: Optional[int] = typer.Option(None, "--omni-dp-size-local", help="vllm-omni's: replicas of the --stage-id stage run here (as --num-replicas); other than 1 needs --stage-id."),
    max_model_len: Optional[str] = typer.Option(None, "--max-model-len", help="Engine flag: context length (2048, 32k, 32K); in stage mode this replica's (and the head's frontends')."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="Per-stage engine flag: max concurrent sequences."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Per-stage engine flag: bfloat16 | float32."),
    gpu_memory_utilization: Optional[float] = typer.Option(None, "--gpu-memory-utilization", help="Per-stage engine flag (vLLM stages)."),
    enforce_eager: Optional[bool] = typer.Option(None, "--enforce-eager", help="Per-stage engine flag (vLLM stages)."),
    tensor_parallel_size: Optional[int] = typer.Option(None, "-tp", "--tensor-parallel-size", help="Engine flag (vLLM stages; 1 everywhere else)."),
    trust_remote_code: Optional[bool] = typer.Option(None, "--trust-remote-code", help="Engine flag (vLLM stages; omni's own engines run no remote code)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved deploy config (JSON) and the per-stage engine flags, then exit."),
    omni: bool = typer.Option(False, "--omni", help="Accepted for vllm-omni compatibility; omni serve is always omni."),
    engine_args: Optional[str] = typer.Option(None, "--engine-args", help='Per-stage engine args as JSON (also --engine-args.key value).'),
    state_dir: Optional[str] = typer.Option(None, "--state-dir", help="Where the master persists shared state (voices, jobs)."),
    log_level: str = typer.Option("WARNING", "--log-level", help="Python log level of omni's processes."),
    max_request_bytes: int = typer.Option(16 << 20, "--max-request-bytes", help="Largest HTTP request body; larger ones get 413, refused from Content-Length before reading."),
    timeout_keep_alive: float = typer.Option(5.0, "--timeout-keep-alive", help="Seconds an HTTP connection may sit idle, and may take to send a request's head (headers)."),
    timeout_request_body: float = typer.Option(60.0, "--timeout-request-body", help="Seconds a request body may take to arrive once its head did; later: 408."),
    timeout_response_write: float = typer.Option(60.0, "--timeout-response-write", help="Seconds one write of a response (a stream's chunk, 64 KiB of a whole body) may wait for the client to take it (nginx's send_timeout); a client that reads nothing for longer has its response ended, its connection closed and its request cancelled."),
    backlog: int = typer.Option(2048, "--backlog", help="Listen backlog of the HTTP socket (connections the kernel queues before accept)."),
    shutdown_timeout: Optional[int] = typer.Option(None, "--shutdown-timeout", help="vLLM's: on Ctrl-C/SIGTERM the API frontends take no new requests and let in-flight ones finish for up to this many seconds (the stages serve them meanwhile), then end open streams with a 'server shutting down' error; 0: at once. Unset: 5 s of grace."),
) -> None:
    """Serve MODEL's pipeline: everything on this host, the head (--stage-id 0), or one headless stage.

    Any other vLLM engine flag (--max-num-batched-tokens 4096, --enable-prefix-caching ...) is passed
    to the stages whose engine takes it. vllm-omni's --init-timeout, --stage-init-timeout and
    --omni-heartbeat-timeout set omni's start-up bound and lease; --no-async-chunk makes the audio
    stage decode each utterance whole (--async-chunk: stream, whatever the deploy YAML says)."""
    from omni import config as cfg
    from omni import mm_limits, serve_modes, vllm_omni_flags, vllm_serve_flags
    from omni.api import cors
    from omni.config_stage_checks import check_counts, normalise_human_ints
    from omni.engine_flags import context_length, flag_name, merge_overrides, parse_extra_flags, spread_flags

    if model is None:
        raise ConfigError("no model: give MODEL (omni serve MODEL ...), --model MODEL or model: in --config FILE")
    serve_modes.refuse_head_only(ctx, headless)   # before the checks and warnings of flags it would not use
    if api_server_count < 1:
        raise ConfigError(f"--api-server-count must be >= 1, got {api_server_count}")
    for flag, value in (("--port", port), ("--omni-master-port", omni_master_port)):
        if value is not None and not 0 <= value <= 65535:
            raise ConfigError(f"{flag} must be a TCP port, 0-65535 (0: any free one), got {value}")
    log_level = _log_level(log_level)
    envs.default_vllm_log_level(log_level)   # before anything imports vLLM: its INFO lines at omni's WARNING
    api_keys = _api_keys(api_keys)
    served_model_names = _served_names(served_model_names)
    _refuse_empty_key("--control-api-key", "OMNI_CONTROL_API_KEY", control_api_key)
    envs.OMNI_SPIN_US   # noqa: B018 -- a bad value is refused here, not later in each stage
    refuse_empty_token(omni_token)
    from omni.api.limits import HttpLimits

    http_limits = HttpLimits(max_request_bytes=max_request_bytes, timeout_keep_alive=timeout_keep_alive,
                             timeout_request_body=timeout_request_body, timeout_response_write=timeout_response_write,
                             backlog=backlog, shutdown_timeout=shutdown_timeout,
                             allowed_hosts=tuple(allowed_hosts or ()))
    cores = os.cpu_count() or 1
    if api_server_count > cores:
        print(f"omni: warning: --api-server-count {api_server_count} is more than the {cores} CPU cores here; "
              "extra frontends only add contention", file=sys.stderr)
    num_replicas = serve_modes.replicas(num_replicas, omni_dp_size_local, stage_id)
    if num_replicas is not None and num_replicas < (0 if stage_id == 0 and not headless else 1):
        raise ConfigError(f"--num-replicas must be >= 1 (0 only on the head, --stage-id 0 without --headless), "
                          f"got {num_replicas}")
    if disable_control_routes and control_api_key:
        raise ConfigError("--control-api-key and --disable-control-routes contradict each other: "
                          "a key guards the control routes, the other flag turns them off")
    from omni.master.auth import refuse_open_master
    from omni.stage.main import check_advertise, check_replica_address, is_wildcard

    if headless and omni_master_address is not None and omni_master_port is not None:
        check_advertise(omni_replica_address, f"{omni_master_address}:{omni_master_port}", omni_token)
    else:
        check_replica_address(omni_replica_address, omni_token)   # stage 0, single-command
    if not headless:                              # the modes that host the master
        refuse_open_master(omni_master_address or "127.0.0.1", omni_token, "--omni-master-address")
    if omni_master_address is not None and is_wildcard(omni_master_address) and not omni_replica_address:
        print(f"omni: warning: --omni-master-address {omni_master_address} is a wildcard, so this process "
              "advertises 127.0.0.1 to its peers; stages on other hosts cannot reach it. Pass "
              "--omni-replica-address with this host's address.", file=sys.stderr)
    for flag, value in (("--deploy-config", deploy_config), ("--stage-configs-path", stage_configs_path)):
        if value == "":   # read as unset, it served MODEL's bundled deploy instead
            raise ConfigError(f"{flag} is empty; give a deploy YAML's path (or a bundled deploy's name), or leave it out")
    if stage_configs_path is not None:
        if deploy_config is not None:
            raise ConfigError("--deploy-config and --stage-configs-path both name the deploy; pass one")
        deploy_config = stage_configs_path
    if headless and stage_id is None:
        raise ConfigError("--headless needs --stage-id K (which stage to run)")
    if stage_id is not None and (omni_master_address is None or omni_master_port is None):
        raise ConfigError("--stage-id needs --omni-master-address and --omni-master-port (where the head's master is)")
    if stage_id is not None and stage_overrides is not None:
        raise ConfigError("--stage-overrides is for single-command mode; with --stage-id use per-stage flags "
                          "(--max-model-len, --engine-args ...)")
    if stage_id == 0 and headless:
        pass  # a headless stage 0 replica: allowed (extra thinker capacity)
    from omni.master.auth import serve_tls

    master_tls, client_tls = serve_tls(tls_cert, tls_key, tls_ca, hosts_master=not headless)
    flags = {"max_model_len": context_length(max_model_len), "max_num_seqs": max_num_seqs, "dtype": dtype,
             "gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": enforce_eager,
             "tensor_parallel_size": tensor_parallel_size, "trust_remote_code": trust_remote_code}
    typed: dict[str, str] = {}                      # each extra flag as typed: --x false is not --no-x
    flags.update(parse_extra_flags(list(ctx.args), typed))
    check_counts(flags, flag_name)                  # named as typed: later they reach the stages as overrides
    mm_limits.check(flags, flag_name)
    cors_flags = cors.take(flags, headless)         # vLLM's CORS options: the frontends answer those origins
    if cors_flags:
        http_limits = dataclasses.replace(http_limits, **cors_flags)
    vllm_serve_flags.take(flags, typed)             # vLLM's HTTP-server options: no-ops or refused
    orchestration = vllm_omni_flags.take(flags)     # vllm-omni's own options with a meaning here
    more = normalise_human_ints(_json_flag("--engine-args", engine_args) or {}, lambda k: f"--engine-args {k}")
    check_counts(more, lambda k: f"--engine-args {k}")
    mm_limits.check(more, lambda k: f"--engine-args {k}")
    flags.update(more)
    for key in more:
        typed.pop(key, None)                        # --engine-args' value won: not the flag's
    async_chunk = flags.pop("async_chunk", None)    # also --engine-args' (vllm-omni's OmniEngineArgs field)
    if async_chunk is not None and not isinstance(async_chunk, bool):
        raise ConfigError(f"--async-chunk takes no value (or --no-async-chunk; async_chunk: true or false), "
                          f"got {async_chunk!r}")
    cli_argv.take_hf_token(flags)                  # a secret: by environment, never argv or the config
    flags = {k: v for k, v in flags.items() if v is not None}
    user_overrides = _json_flag("--stage-overrides", stage_overrides)
    config = cfg.load(model, deploy_config, user_overrides, async_chunk)
    if flags and stage_id is None:
        # Single-command mode: each flag goes to every stage whose engine takes it (hashed).
        config = cfg.load(model, deploy_config, merge_overrides(spread_flags(config, flags, typed=typed), user_overrides),
                          async_chunk)
        flags = {}
    if stage_id is not None:   # this stage's flags by the same rule, before anything starts; names a bad id's range
        flags = spread_flags(config, flags, stage_id, typed).get(str(stage_id), {})
    serve_modes.check_state_dir(state_dir, headless, dry_run)
    if dry_run:
        from omni.master.configdiff import shown   # users put HF_TOKEN and the like in env: the keys only

        print(json.dumps({"config": shown(config.to_dict()), "engine_flags": flags, "num_replicas": num_replicas,
                          "orchestration": dataclasses.asdict(orchestration)}, indent=1))
        # stderr, exit 0: stdout stays the JSON, and a config is checked on a box without the weights too
        from omni.models.resolve import located, stage_models

        for name in stage_models(config, None if stage_id is None else [stage_id]):
            typer.echo(f"model: {located(name)}", err=True)
        raise typer.Exit(0)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = omni_token or ""

    if headless and (num_replicas or 1) == 1:
        cli_argv.reexec_with_env(config.stage(stage_id).env)   # the stage's env from the interpreter's start
        from omni.stage.main import StageOptions, run_stage

        # --init-timeout / --stage-init-timeout bound the wait for the master here (no launcher deadline).
        opts = StageOptions(master_address=f"{omni_master_address}:{omni_master_port}", token=token,
                            replica_address=omni_replica_address, tls=client_tls,
                            register_wait_s=orchestration.startup_timeout_s or StageOptions.register_wait_s)
        vllm_omni_flags.head_only(orchestration)
        raise typer.Exit(run_stage(config, stage_id, opts, engine_flags=flags))

    from omni.launcher import LaunchPlan, Launcher

    if headless:
        plan = LaunchPlan(config, stages=[stage_id], master_host=omni_master_address,
                          master_port=omni_master_port, host_master=False, api_server_count=0,
                          token=token, replica_address=omni_replica_address, num_replicas=num_replicas,
                          engine_flags=flags, log_level=log_level, orchestration=orchestration, client_tls=client_tls)
        vllm_omni_flags.head_only(orchestration)
    elif stage_id is not None:
        if stage_id != 0:
            raise ConfigError(f"--stage-id {stage_id} without --headless: only stage 0 hosts the master "
                              "and the HTTP frontends; add --headless")
        # --num-replicas 0: a head of master and frontends only; every stage registers from elsewhere.
        plan = LaunchPlan(config, stages=[0] if num_replicas != 0 else [], master_host=omni_master_address,
                          master_port=omni_master_port,
                          api_server_count=api_server_count, host=host, port=port, token=token,
                          api_keys=api_keys, served_model_names=served_model_names,
                          control_api_key=control_api_key, control_routes=not disable_control_routes,
                          replica_address=omni_replica_address, num_replicas=num_replicas or None,
                          engine_flags=flags, log_level=log_level, state_dir=state_dir, http_limits=http_limits,
                          orchestration=orchestration, master_tls=master_tls, client_tls=client_tls)
    else:
        plan = LaunchPlan(config, stages=[s.stage_id for s in config.stages],
                          master_host=omni_master_address or "127.0.0.1", master_port=omni_master_port or 0,
                          api_server_count=api_server_count, host=host, port=port, token=token,
                          api_keys=api_keys, served_model_names=served_model_names, log_level=log_level,
                          control_api_key=control_api_key, control_routes=not disable_control_routes,
                          state_dir=state_dir, http_limits=http_limits, num_replicas=num_replicas,
                          replica_address=omni_replica_address, orchestration=orchestration,
                          master_tls=master_tls, client_tls=client_tls)
    raise typer.Exit(Launcher(plan).run())


def _print_version(value: bool) -> None:
    if value:
        import omni

        typer.echo(f"omni {omni.version()}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", callback=_print_version, is_eager=True,
                                       help="Print omni's version and exit.")) -> None:
    """omni: a Ray-free distributed stage runtime for multi-stage model serving."""


def _register_master_commands() -> None:
    from omni.master import commands

    checked = _token_checked
    app.command("master", help="Run a standalone omni master (gRPC).")(checked(commands.master))
    app.command("status", help="Show the topology, health and load of a running omni deployment.")(
        checked(commands.status))
    from omni.master import admin

    app.command("drain", help="Drain stage replicas: they finish what they hold and get no new requests.")(
        checked(admin.drain))
    app.command("undrain", help="Take drained stage replicas back into service.")(checked(admin.undrain))
    app.command("sleep", help="Put stage engines to sleep through the master.")(checked(admin.sleep))
    app.command("wakeup", help="Wake sleeping stage engines through the master.")(checked(admin.wakeup))


_register_master_commands()


def _mask_process_title(argv: list[str]) -> None:
    masked = hide_secrets(argv)
    if masked == argv:
        return
    try:
        import setproctitle   # rewrites /proc/PID/cmdline in place (installed with vLLM)
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(["omni", *masked]))


def main(argv: list[str] | None = None) -> None:
    argv = given = cli_argv.given = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = serve_argv.normalise(argv)   # vLLM's --model and --config FILE.yaml: before any other reading
        argv = spread_several_values(argv)
        _mask_process_title(argv)   # after the spread: each of several keys is masked
        if argv[:1] == ["serve"]:     # vLLM's and vllm-omni's short forms (-q, -O3, -oma ...)
            from omni.engine_flags import spell_out

            argv = spell_out(argv, SHORT_FLAGS)     # never an option's value (`--api-key -oma` is a key)
        else:
            argv = [SHORT_FLAGS.get(a, a) for a in argv]
        argv = fold_dotted_args(argv)
        app(args=argv, prog_name="omni", standalone_mode=True)
    except OmniError as e:
        print(f"omni: error: {mask_in_message(str(e), given)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
