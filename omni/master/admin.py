"""`omni drain`, `omni undrain`, `omni sleep`, `omni wakeup`: commands fanned out by the master.

Each goes to the master (token/TLS like `omni status`), which sends it down the keep-alive
stream of every targeted replica and collects their acks. Exit 0 when every targeted replica
acked ok, 1 when one refused or did not answer or the master refused the command (below), 2 when
the master cannot be reached or the target names nothing, 130 on Ctrl-C (the calls run on a thread:
commands.in_thread). Draining or sleeping the last READY, awake replica of a stage stops that stage:
the master refuses it unless --force, and with --force the command says what it stops.
"""

from __future__ import annotations

import json
import threading
import uuid

import msgspec
import typer

from omni.errors import ConfigError, OmniError
from omni.master import DEFAULT_PORT
from omni.master.commands import (EXIT_INTERRUPTED, EXIT_NOT_READY, EXIT_OK, EXIT_UNREACHABLE, Interrupted,
                                  _local_master, _one_line, _table, client_tls, ctrl_c, in_thread)

# Shared option declarations (typer reads them from each command's signature).
# Default: the `omni serve` on this host, found as `omni status` finds it (its master port is random).
_MASTER = typer.Option(None, "--master", "-m", help="The omni master's HOST:PORT. Default: the `omni serve` "
                       f"running on this host, else 127.0.0.1:{DEFAULT_PORT}.")
_STAGE = typer.Option(None, "--stage", help="Only these stage ids (repeat the flag); default: every stage.")
_REPLICA = typer.Option(None, "--replica", help="Only these replica ids, as `omni status` lists them (repeat it).")
_JSON = typer.Option(False, "--json", help="Print one JSON document.")
# the master waits at most this long (server.MAX_COMMAND_TIMEOUT_S); inf passed min=0.1 alone
MAX_TIMEOUT_S = 600.0
_TIMEOUT_HELP = f"Seconds to wait for the acks (at most {MAX_TIMEOUT_S:g})."
_TOKEN = typer.Option(None, "--omni-token", envvar="OMNI_TOKEN", help="The master's token (env OMNI_TOKEN).")
_CERT = typer.Option(None, "--tls-cert", help="PEM client certificate (mTLS).")
_KEY = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert.")
_CA = typer.Option(None, "--tls-ca", help="PEM CA to verify the master (enables TLS).")
_FORCE = typer.Option(False, "--force", help="Also when it takes the last READY replica of a stage out of service.")


def _run(kind: str, master: str | None, stage: list[int] | None, replica: list[str] | None, args: dict,
         timeout: float, json_: bool, omni_token: str | None, tls: tuple, force: bool = False) -> None:
    from omni.master.client import MasterClient

    verb = kind.lower().replace("_", "")
    if stage and replica:
        typer.echo(f"omni {verb}: --stage and --replica: give one, not both (a replica id, as `omni status` "
                   "lists it, names its stage)", err=True)
        raise typer.Exit(EXIT_UNREACHABLE)
    files = client_tls(verb, *tls)
    if master is None:
        master, files = _local_master(verb, tls=files, only_one=True)
    try:
        # Ctrl-C only sets `stop`; the calls run on a thread (commands.in_thread: no KeyboardInterrupt in grpc).
        with ctrl_c() as stop, MasterClient(master, token=omni_token, tls=files, timeout_s=5.0) as client:
            st = in_thread(client.get_status, stop)
            known = {r.replica_id for r in st.replicas if r.role == "STAGE"}
            unknown = sorted(set(replica or ()) - known)
            if unknown:
                typer.echo(f"omni {verb}: --replica {', '.join(unknown)}: no such stage replica "
                           f"(known: {', '.join(sorted(known)) or 'none'})", err=True)
                raise typer.Exit(EXIT_UNREACHABLE)
            stages = {s.stage_id for s in st.stages}
            bad = sorted(set(stage or ()) - stages)
            if bad:
                typer.echo(f"omni {verb}: --stage {', '.join(map(str, bad))}: no such stage "
                           f"(the pipeline has {', '.join(map(str, sorted(stages))) or 'none'})", err=True)
                raise typer.Exit(EXIT_UNREACHABLE)
            try:
                if args.get("mode") == "wait":
                    token = uuid.uuid4().hex
                    try:
                        results = in_thread(lambda: _sleep_waiting(client, st, stage, replica, args["level"], timeout,
                                                                   force, token), stop)
                    except Interrupted:   # the frontends admit again, not only when the hold runs out
                        _lift(client, token)
                        raise
                else:
                    results = in_thread(lambda: client.send_command(kind, stage or (), args, timeout_s=timeout,
                                                                    replica_ids=replica or (), keep_serving=not force),
                                        stop)
            except ConfigError as e:   # FAILED_PRECONDITION: the master refused (the last READY replica)
                typer.echo(f"omni {verb}: {_one_line(str(e))}", err=True)
                raise typer.Exit(EXIT_NOT_READY) from None
    except Interrupted:
        typer.echo(f"omni {verb}: interrupted (a command already sent may still reach its replicas: "
                   "see `omni status`)", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except OmniError as e:
        typer.echo(f"omni {verb}: {_one_line(str(e))}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    if json_:
        print(json.dumps({"command": kind, "results": msgspec.to_builtins(results)}, sort_keys=True))
    elif results:
        print("\n".join(_table(["STAGE", "REPLICA", "OK", "OUTCOME", "MESSAGE"],
                               [[str(r.stage_id), r.replica_id, "yes" if r.ok else "no", r.outcome, r.message]
                                for r in results])), flush=True)
    if force:   # after the outcome, for what did stop: a replica that refused (cannot sleep) still serves
        for line in _what_stops(st, {r.replica_id for r in results if r.ok}):
            typer.echo(f"omni {verb}: --force: {line}", err=True)
    if not results:
        typer.echo(f"omni {verb}: no live stage replica matched", err=True)
        raise typer.Exit(EXIT_UNREACHABLE)
    raise typer.Exit(EXIT_OK if all(r.ok for r in results) else EXIT_NOT_READY)


def _sleep_waiting(client, st, stage, replica, level: int, timeout: float, force: bool, token: str) -> list:
    """--mode wait: the frontends hold new requests and the stages sleep once none is in flight (as the HTTP
    route's mode=wait: omni/orchestrator/quiesce.py); a frontend still busy after --timeout: nothing sleeps."""
    import asyncio

    from omni.master.types import sleep_stops
    from omni.orchestrator import quiesce

    if not force:   # the master checks it at the SLEEP, after the frontends held every request for the wait
        targets = {r.replica_id for r in st.replicas if r.role == "STAGE" and (not stage or r.stage_id in stage)
                   and (not replica or r.replica_id in replica) and sleep_stops(r.capabilities)}
        stops = [f"stage {sid} ({', '.join(serving)})" for sid, serving in _stopped_stages(st, targets)]
        if stops:
            raise ConfigError(f"sleep would stop {'; '.join(stops)}: no READY, awake replica would be left; "
                              "nothing was held or put to sleep. Repeat with --force to do it anyway")
    quiet, results = asyncio.run(quiesce.sleep_when_idle(
        quiesce.SyncMaster(client), level, min(timeout, quiesce.MAX_WAIT_S), tuple(stage or ()), token=token,
        replica_ids=replica or (), keep_serving=not force))
    if results is None:
        busy = "; ".join(f"{r.replica_id}: {r.message}" for r in quiet if not r.ok)
        raise ConfigError(f"nothing was put to sleep: a frontend still had requests in flight ({busy})")
    return results


def _lift(client, token: str) -> None:
    """QUIESCE hold_s 0 for an interrupted wait, on a thread of its own (no grpc call on the thread Ctrl-C
    interrupts), bounded: the holds also run out by themselves."""
    def send() -> None:
        try:
            client.send_command("QUIESCE", (), {"hold_s": 0.0, "token": token}, timeout_s=5.0)
        except Exception:   # the master away: the holds end by themselves
            pass

    t = threading.Thread(target=send, daemon=True)
    t.start()
    t.join(10.0)


def drain(
    master: str | None = _MASTER, stage: list[int] = _STAGE, replica: list[str] = _REPLICA,
    timeout: float = typer.Option(10.0, "--timeout", min=0.1, max=MAX_TIMEOUT_S, help=_TIMEOUT_HELP),
    json_: bool = _JSON, omni_token: str | None = _TOKEN,
    tls_cert: str | None = _CERT, tls_key: str | None = _KEY, tls_ca: str | None = _CA, force: bool = _FORCE,
) -> None:
    """Stop sending new requests to replicas (they finish what they hold; frontends route around them)."""
    _run("DRAIN", master, stage, replica, {}, timeout, json_, omni_token, (tls_cert, tls_key, tls_ca), force)


def undrain(
    master: str | None = _MASTER, stage: list[int] = _STAGE, replica: list[str] = _REPLICA,
    timeout: float = typer.Option(10.0, "--timeout", min=0.1, max=MAX_TIMEOUT_S, help=_TIMEOUT_HELP),
    json_: bool = _JSON, omni_token: str | None = _TOKEN,
    tls_cert: str | None = _CERT, tls_key: str | None = _KEY, tls_ca: str | None = _CA,
) -> None:
    """Take DRAINING replicas back: they are READY again and frontends send them requests."""
    _run("UNDRAIN", master, stage, replica, {}, timeout, json_, omni_token, (tls_cert, tls_key, tls_ca))


def _what_stops(st, stopped: set[str]) -> list[str]:
    """The stages that `st` (before the command) had serving and that have no READY, awake replica now that
    `stopped` (the replicas that acked ok) stopped serving."""
    return [f"stage {sid} has no awake READY replica now ({', '.join(serving)}); its requests fail until it is back"
            for sid, serving in _stopped_stages(st, stopped)]


def _stopped_stages(st, stopped: set[str]) -> list[tuple[int, list[str]]]:
    """(stage id, its serving replicas) of each stage whose serving replicas are all in `stopped`."""
    out = []
    for s in st.stages:
        serving = [r.replica_id for r in st.serving(s.stage_id)]
        if serving and all(r in stopped for r in serving):
            out.append((s.stage_id, serving))
    return out


# vLLM's levels; omni's own engines move their whole pipeline to host memory at level 1
_LEVEL_HELP = ("1: offload the weights to host memory and discard the KV cache; "
               "2: discard the weights too (read again from the model folder at wake-up).")


_MODE_HELP = ("refuse: a replica with requests in flight refuses to sleep; abort: it ends them (each with a 503 "
              "that says why) and sleeps, as vLLM's POST /sleep does by default; wait: the frontends refuse new "
              "requests and the stages sleep once the ones in flight end (up to --timeout seconds).")


def sleep(
    master: str | None = _MASTER, stage: list[int] = _STAGE, replica: list[str] = _REPLICA,
    level: int = typer.Option(1, "--level", min=1, max=2, help=_LEVEL_HELP),
    mode: str = typer.Option("refuse", "--mode", help=_MODE_HELP),
    timeout: float = typer.Option(60.0, "--timeout", min=0.1, max=MAX_TIMEOUT_S, help=_TIMEOUT_HELP),
    json_: bool = _JSON, omni_token: str | None = _TOKEN,
    tls_cert: str | None = _CERT, tls_key: str | None = _KEY, tls_ca: str | None = _CA, force: bool = _FORCE,
) -> None:
    """Put stage engines to sleep (engines that cannot sleep here say so)."""
    if mode not in ("refuse", "abort", "wait"):
        typer.echo(f"omni sleep: --mode {mode!r}: use refuse, abort or wait", err=True)
        raise typer.Exit(EXIT_UNREACHABLE)
    _run("SLEEP", master, stage, replica, {"level": level, "mode": mode}, timeout, json_, omni_token,
         (tls_cert, tls_key, tls_ca), force)


def wakeup(
    master: str | None = _MASTER, stage: list[int] = _STAGE, replica: list[str] = _REPLICA,
    timeout: float = typer.Option(60.0, "--timeout", min=0.1, max=MAX_TIMEOUT_S, help=_TIMEOUT_HELP),
    json_: bool = _JSON, omni_token: str | None = _TOKEN,
    tls_cert: str | None = _CERT, tls_key: str | None = _KEY, tls_ca: str | None = _CA,
) -> None:
    """Wake sleeping stage engines."""
    _run("WAKE_UP", master, stage, replica, {}, timeout, json_, omni_token, (tls_cert, tls_key, tls_ca))
