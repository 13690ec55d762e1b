"""What `omni serve`'s modes take: the flags only the head (single-command or --stage-id 0) has a use for are
refused by name with --headless, as vllm-omni refuses --api-server-count there, never dropped unread; and
--state-dir is checked before anything starts."""

from __future__ import annotations

from typing import Any

from omni.errors import ConfigError

__all__ = ["HEAD_ONLY", "check_state_dir", "refuse_head_only", "replicas"]

# serve's parameter -> its flag: the HTTP frontends' and the master's, which a headless stage runs neither of.
HEAD_ONLY = {
    "host": "--host", "port": "--port", "api_server_count": "--api-server-count", "api_keys": "--api-key",
    "served_model_names": "--served-model-name", "control_api_key": "--control-api-key",
    "disable_control_routes": "--disable-control-routes", "state_dir": "--state-dir",
    "max_request_bytes": "--max-request-bytes", "timeout_keep_alive": "--timeout-keep-alive",
    "timeout_request_body": "--timeout-request-body", "timeout_response_write": "--timeout-response-write",
    "backlog": "--backlog", "shutdown_timeout": "--shutdown-timeout", "allowed_hosts": "--allowed-hosts",
}


def refuse_head_only(ctx: Any, headless: bool) -> None:
    """With --headless, a head-only flag given on the command line is an error naming it. Only the command line
    counts: OMNI_CONTROL_API_KEY in a shared environment is no mistake of this command's. `ctx`: typer's context
    (its click may be typer's own copy: the source is read by name)."""
    if not headless:
        return
    given = [flag for name, flag in HEAD_ONLY.items()
             if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]
    if given:
        them = "it" if len(given) == 1 else "them"
        raise ConfigError(f"{', '.join(given)}: not with --headless (a headless stage runs no HTTP frontend and no "
                          f"master); give {them} to the head (--stage-id 0, or single-command mode)")


def check_state_dir(state_dir: str | None, headless: bool, dry_run: bool) -> None:
    """A --state-dir the master could not use is refused here (a dry run creates nothing)."""
    if state_dir is None or headless:
        return
    from omni.master.kv import check_state_dir as check

    check(state_dir, create=not dry_run)


def replicas(num_replicas: int | None, dp_size_local: int | None, stage_id: int | None) -> int | None:
    """The replicas run here: omni's --num-replicas (with no --stage-id: of every stage), or vllm-omni's
    --omni-dp-size-local, which as in vllm-omni counts only the replicas of this process's --stage-id: other
    than 1 without it is refused (it ran N replicas of every stage), 1 is vllm-omni's default."""
    if dp_size_local is None:
        return num_replicas
    if dp_size_local < 1:
        raise ConfigError(f"--omni-dp-size-local must be >= 1, got {dp_size_local}")
    if stage_id is None:
        if dp_size_local != 1:
            raise ConfigError("--omni-dp-size-local != 1 requires --stage-id to be set (omni's --num-replicas N "
                              "runs N replicas of every stage)")
        return num_replicas
    if num_replicas is not None and num_replicas != dp_size_local:
        raise ConfigError(f"--num-replicas {num_replicas} and --omni-dp-size-local {dp_size_local} both count "
                          "this stage's replicas; pass one")
    return dp_size_local
