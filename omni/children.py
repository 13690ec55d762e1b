"""`python -m omni.children stage|frontend ...`: how the launcher starts its children.

Internal; users run `omni serve`. The config arrives resolved, so every child
computes the same config hash as the head.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from omni import envs


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="omni.children")
    ap.add_argument("role", choices=["stage", "frontend"])
    ap.add_argument("--config", required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--stage-id", type=int)
    ap.add_argument("--replica-hint", type=int, default=-1)
    ap.add_argument("--replica-address")
    ap.add_argument("--register-wait-s", type=float)   # the launcher's start-up deadline
    ap.add_argument("--engine-flags")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--listen-fd", type=int)
    ap.add_argument("--served-model-name", action="append", default=[])   # once per name (--x=NAME), first reported
    ap.add_argument("--jobs-dir")
    ap.add_argument("--http-limits")   # JSON of omni.api.limits.HttpLimits
    ap.add_argument("--max-model-len", type=int)   # the head's --max-model-len (stage mode): unhashed
    ap.add_argument("--parent-pid", type=int)
    # How to connect to the master: --tls alone, the system's CAs; the files' paths (never their content).
    ap.add_argument("--tls", action="store_true")
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    ap.add_argument("--tls-ca")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.parent_pid:
        from omni.proctree import die_with_parent

        die_with_parent(signal.SIGTERM, a.parent_pid)   # even when the launcher is SIGKILLed
    with open(a.config) as f:
        config_json = f.read()
    from omni.master.auth import TlsFiles

    token = envs.OMNI_TOKEN
    tls = TlsFiles(a.tls_cert, a.tls_key, a.tls_ca) if a.tls else None
    if a.role == "stage":
        from omni.config import loads_json
        from omni.stage.main import StageOptions, run_stage
        import logging

        logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = loads_json(config_json)
        opts = StageOptions(master_address=a.master, token=token, replica_address=a.replica_address,
                            replica_hint=a.replica_hint, tls=tls,
                            register_wait_s=a.register_wait_s or StageOptions.register_wait_s)
        flags = json.loads(a.engine_flags) if a.engine_flags else None
        return run_stage(config, a.stage_id, opts, engine_flags=flags)
    from omni.frontend import main_from_args

    return main_from_args(config_json, index=a.index, master_address=a.master, token=token, tls=tls,
                          host=a.host, port=a.port, listen_fd=a.listen_fd,
                          # Secrets come by environment, never argv (world-readable in ps).
                          api_key=envs.OMNI_API_KEYS, served_model_name=a.served_model_name, log_level=a.log_level,
                          jobs_dir=a.jobs_dir, http_limits=json.loads(a.http_limits) if a.http_limits else None,
                          max_model_len=a.max_model_len,
                          # Like the token, the control key comes by environment, not argv.
                          control_api_key=envs.OMNI_CONTROL_API_KEY, control_routes=envs.OMNI_CONTROL_ROUTES)


if __name__ == "__main__":
    sys.exit(main())
