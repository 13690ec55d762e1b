"""Entry of an API frontend process: tokenizer + Orchestrator + Starlette app on Hypercorn.

Each frontend registers with the master as a FRONTEND (so `omni status` lists it
with its request counts), follows the topology through WatchTopology, and opens
its own channel to every stage replica it routes to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from typing import Sequence

from omni import latency_trace
from omni.config import DeployConfig, prompt_stage
from omni.config_checks import TALKER_REFUSED
from omni.errors import OmniError
from omni.heap import freeze_after_startup
from omni.models.resolve import model_config

logger = logging.getLogger(__name__)


def _tokenizer_model(config: DeployConfig) -> str | None:
    s = prompt_stage(config)
    return None if s is None else s.model or config.model


def _max_model_len(config: DeployConfig) -> int:
    """The prompt stage's context until its replicas report theirs (follow_context): its max_model_len,
    else for vLLM the model's own (vLLM's default; the bundled GPU deploys set none), else 2048."""
    s = prompt_stage(config)
    if s is None:
        return 2048
    if "max_model_len" in s.engine_args:
        return int(s.engine_args["max_model_len"])
    own = model_context(s.model or config.model) if s.engine == "vllm" else None
    return own or 2048


def refused_sampling(config: DeployConfig) -> dict[str, str]:
    """Sampling parameters the prompt stage's engine refuses for every request: a vLLM stage that captures
    hidden states for a talker (mm_hidden_layer, hidden_rows_layer) does it through vLLM's speculative
    decoding, which takes no logit_bias (nor min_p, refused everywhere): a 400 naming it, not vLLM's."""
    s = prompt_stage(config)
    if s is not None and s.engine == "vllm" and any(s.engine_args.get(k) is not None
                                                    for k in ("mm_hidden_layer", "hidden_rows_layer")):
        return {"logit_bias": f"its {s.label} captures hidden states for the talker through "
                              "vLLM's speculative decoding, which takes no logit_bias"}
    return {}


def refused_stage_sampling(config: DeployConfig) -> dict[int, dict[str, str]]:
    """Per later stage, what its engine refuses in a sampling_params_list entry (a talker's presence and
    frequency penalties): a 400 naming the entry's field before the thinker runs, not the talker's error."""
    return {s.stage_id: TALKER_REFUSED[s.engine] for s in config.stages if s.engine in TALKER_REFUSED}


def stage_sampling(fe, config: DeployConfig) -> None:
    """What FrontendState checks a sampling_params_list entry against: each talker's refused fields and each
    stage's engine (config_checks.UNSAMPLED, VOCODERS)."""
    fe.refused_stage_sampling = refused_stage_sampling(config)
    fe.stage_engines = {s.stage_id: s.engine for s in config.stages}


def model_context(model: str | None) -> int | None:
    """max_position_embeddings of a local model's config.json: the text model's (text_config, or
    thinker_config.text_config for Qwen-Omni); None when it is not at hand."""
    cfg = model_config(model)
    if cfg is None:
        return None
    thinker = cfg.get("thinker_config") or {}
    for c in (thinker.get("text_config"), thinker, cfg.get("text_config"), cfg):
        if isinstance(c, dict) and isinstance(c.get("max_position_embeddings"), int):
            return c["max_position_embeddings"]
    return None


def _sampling_defaults(config: DeployConfig) -> dict:
    s = prompt_stage(config)
    if s is None:
        return {}
    d = s.default_sampling_params
    out: dict = {"sampling_defaults": d}
    if d.max_tokens is not None:
        out["default_max_tokens"] = d.max_tokens
    return out


async def follow_topology(master, topology, stop: asyncio.Event) -> None:
    """Keep the topology current; reconnect with backoff when the master goes away."""
    from omni.errors import OmniError

    backoff = 0.1
    loop = asyncio.get_running_loop()
    timer: asyncio.TimerHandle | None = None

    def expire() -> None:    # replicas a resync's snapshot missed that did not register again in time
        nonlocal timer
        timer = None
        topology.expire()
        arm()

    def arm() -> None:
        nonlocal timer
        due = topology.expiry_in()
        if due is not None and timer is None:
            timer = loop.call_later(due, expire)

    try:
        while not stop.is_set():
            try:
                async for event in master.watch():
                    topology.apply(event)
                    arm()
                    backoff = 0.1
                    if stop.is_set():
                        return
            except OmniError as e:
                logger.warning("topology watch: %s", e)
            except asyncio.CancelledError:
                return
            topology.connected = False   # still served from: a master restart is no outage (Orchestrator.health)
            try:
                async with asyncio.timeout(backoff):
                    await stop.wait()
            except TimeoutError:
                pass
            backoff = min(2.0, backoff * 2)
    finally:
        if timer is not None:
            timer.cancel()


async def publish_metrics(app, amaster, topology, index: int, stop: asyncio.Event) -> None:
    """Publish this frontend's metrics for the others' /metrics, and let its own /metrics read
    the live others' (omni/api/metrics_merge.py)."""
    from omni.api.admin import AdminRoutes
    from omni.api.metrics_merge import NAMESPACE, PUBLISH_S, Publisher
    from omni.errors import BadRequest

    fe = app.state.frontend
    admin = AdminRoutes(fe)

    async def peers() -> list[str]:
        live = {str(int(r.extra.get("frontend_index", -1))) for r in topology.replicas.values()
                if r.role == "FRONTEND" and r.state != "DEAD"}
        entries = await amaster.kv_list(NAMESPACE)
        return [v.decode() for k, v in sorted(entries.items()) if k != str(index) and k in live]

    fe.peer_metrics = peers
    fe.publish_metrics = Publisher(admin.own_metrics, amaster, index).publish
    while not stop.is_set():
        try:
            await fe.publish_metrics()
        except BadRequest:       # refused, and said so (Publisher): try again next round
            pass
        except Exception as e:   # the master is away: try again next round
            logger.info("metrics publish failed: %s: %s", type(e).__name__, e)
        try:
            async with asyncio.timeout(PUBLISH_S):
                await stop.wait()
        except TimeoutError:
            pass


async def serve_frontend(config: DeployConfig, *, index: int, master_address: str, token: str,
                         host: str, port: int, api_key: str | Sequence[str] | None,
                         served_model_name: str | Sequence[str],
                         listen_fd: int | None = None, jobs_dir: str | None = None,
                         control_api_key: str | None = None, control_routes: bool = True,
                         limits=None, max_model_len: int | None = None, tls=None) -> None:
    """`max_model_len`: the head's own --max-model-len (stage mode), over the deploy's; `tls`: the
    TlsFiles to connect to the master with (None: plaintext)."""
    from transformers import AutoTokenizer

    from omni.api.app import build_app
    from omni.api.limits import HttpLimits
    from omni.api.jobs import Jobs, Results
    from omni.api.serve import bind_socket, serve
    from omni.master.client import AsyncMasterClient, MasterClient
    from omni.models.resolve import resolve_model
    from omni.orchestrator.executor import Orchestrator
    from omni.orchestrator.limits import follow_limits
    from omni.orchestrator.topology import Topology
    from omni.netaddr import host_port
    from omni.stage.main import advertised_host
    from omni.transport.factory import MultiConsumer
    from omni.voices import MasterVoiceStore

    limits = limits or HttpLimits()
    # The frontend's tensor work is small copies (audio chunks, embeddings): one thread, so no
    # pool of spinning workers competes with the stages for the cores.
    import torch

    torch.set_num_threads(1)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    tok_model = _tokenizer_model(config)
    tokenizer = None
    if tok_model is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # Tokenize on our (niced) tokenizer thread, not on a rayon pool as big as the host.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, resolve_model(tok_model))

    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""

    topology = Topology()
    amaster = AsyncMasterClient(master_address, token=token or None, tls=tls)
    smaster = MasterClient(master_address, token=token or None, tls=tls)
    # This host as peers see it (--host 0.0.0.0 is not an address): status and transport choice.
    advertise = advertised_host(host, master_address)
    logger.info("frontend %d: registering with the omni master at %s", index, master_address)
    reg = await asyncio.to_thread(
        smaster.register, "FRONTEND", -1, config_hash=config.config_hash(), pipeline_config=config.to_dict(),
        replica_hint=index,   # fe{index}, as its metrics label and X-Omni-Frontend say (else in order of arrival)
        endpoints={"http": host_port(advertise, port)}, host=advertise, pid=os.getpid(), wait_s=30.0, stop=stop)
    if reg is None:                 # stopped while the master was away: nothing to undo
        smaster.close()
        await amaster.close()
        return
    # After a master restart, replicas the new master's first snapshot misses get one lease to register again.
    topology.grace_s = reg.lease_ttl_s
    frontend_id = f"{reg.replica_id}-{os.getpid()}"
    orch = Orchestrator(config, frontend_id=frontend_id, topology=topology, detokenize=detokenize,
                        consumer=MultiConsumer(token=token), token=token, host=advertise, master=amaster)
    orch.metrics_label = str(index)
    orch.gate.loop = asyncio.get_running_loop()   # the QUIESCE ack waits a turn of it (quiesce.Gate)

    def load() -> dict:
        return {"queue_len": 0, "in_flight": orch.in_flight,
                "requests_total": orch.metrics.requests_total,
                "cpu_seconds": time.process_time(), "extra": {"frontend_index": float(index)}}

    jobs = None   # the job store, once made below (on_command counts its jobs)

    def on_command(cmd) -> tuple[bool, str]:
        if cmd.kind == "QUIESCE":   # a sleep with mode=wait (omni/orchestrator/quiesce.py); queued jobs count
            return orch.gate.on_command(cmd.args, lambda: orch.in_flight + (jobs.unfinished if jobs else 0))
        return False, f"{cmd.kind} reaches stage replicas, not an API frontend"

    smaster.start_keepalive(load, on_command, interval_s=1.0)
    synced = asyncio.Event()
    topology.on_change(lambda r, kind: synced.set())
    # Not `stop`: the topology and metrics follow on through a stop's drain (--shutdown-timeout).
    done = asyncio.Event()
    watcher = asyncio.create_task(follow_topology(amaster, topology, done))
    publisher = None
    try:
        # Take connections only once the topology is known, so none is answered 503; a stop request
        # meanwhile (the launcher gone: PR_SET_PDEATHSIG) ends the start-up at once.
        try:
            async with asyncio.timeout(60):
                await first_set(synced, stop)
        except TimeoutError:
            raise OmniError(f"no topology from the omni master at {master_address} within 60 s") from None
        if stop.is_set():
            return
        # Accept from the launcher's listener (inherited fd) once the topology is known; alone: our own.
        sock = socket.socket(fileno=listen_fd) if listen_fd is not None else \
            bind_socket(host, port, backlog=limits.backlog)

        def live_frontends():
            # Job owners are named by (host, pid): a re-registration may change the replica id.
            if not topology.connected:
                return None
            return {(r.host, r.pid) for r in topology.replicas.values() if r.role == "FRONTEND" and r.state != "DEAD"}

        # host as registered, so owners match the topology's entries
        jobs = Jobs(amaster, Results(jobs_dir), frontend_index=index, host=advertise, live_frontends=live_frontends)
        jobs.admit = orch.gate.check   # no job is accepted while a sleep with mode=wait holds new requests
        await jobs.start()
        app = build_app(
            orch, tokenizer,
            served_model_name=served_model_name or config.model,
            model_aliases=list(config.aliases) + [config.model], model_path=config.model,
            frontend_index=index,
            max_model_len=max_model_len or _max_model_len(config), num_stages=len(config.stages),
            default_modalities=config.pipeline.default_modalities,
            speech_entry_stage=config.pipeline.speech_entry_stage,
            audio_out=config.final_stage("audio") is not None,
            speakers=tuple(config.pipeline.voices), default_voice=config.pipeline.default_voice,
            max_tokens_limit=config.pipeline.max_tokens_limit, max_speech_chars=config.pipeline.max_speech_chars,
            images=config.pipeline.images if config.final_stage("image") is not None else None,
            videos=config.pipeline.videos if config.final_stage("video") is not None else None,
            voices=MasterVoiceStore(amaster) if config.pipeline.speech_entry_stage is not None else None,
            api_key=api_key,
            control_api_key=control_api_key,
            control_routes=control_routes,
            jobs=jobs,
            limits=limits,
            **_sampling_defaults(config),
        )
        app.state.frontend.refused_sampling = refused_sampling(config)
        stage_sampling(app.state.frontend, config)
        # the head's own --max-model-len stays
        follow_limits(app.state.frontend, topology, config, follow_context=max_model_len is None)
        publisher = asyncio.create_task(publish_metrics(app, amaster, topology, index, done))
        freeze_after_startup()
        latency_trace.enable(f"frontend{index}")
        await serve(app, sock=sock, shutdown_event=stop, limits=limits)
    finally:
        stop.set()
        done.set()
        orch.gate.close()   # a QUIESCE's wait ends with the frontend
        watcher.cancel()
        if publisher is not None:
            publisher.cancel()
        if jobs is not None:
            await jobs.close()
        await orch.close()
        try:
            await asyncio.to_thread(smaster.deregister)
        except Exception as e:
            logger.info("frontend deregister failed: %s", e)
        smaster.close()
        await amaster.close()


async def first_set(*events: asyncio.Event) -> None:
    """Return once any of `events` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def run_loop(main) -> None:
    """Run a frontend's coroutine on uvloop when it is there (OMNI_EVENT_LOOP=asyncio opts out):
    Hypercorn's per-request work is mostly event-loop calls (tasks, timers, socket writes)."""
    from omni import envs

    if envs.OMNI_EVENT_LOOP == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def main_from_args(config_json: str, *, index: int, master_address: str, token: str, host: str,
                   port: int, api_key: str | Sequence[str] | None, served_model_name: str | Sequence[str],
                   log_level: str = "INFO",
                   listen_fd: int | None = None,
                   jobs_dir: str | None = None, control_api_key: str | None = None,
                   control_routes: bool = True, http_limits: dict | None = None,
                   max_model_len: int | None = None, tls=None) -> int:
    from omni.api.limits import HttpLimits
    from omni.config import loads_json

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = loads_json(config_json)
    try:
        run_loop(serve_frontend(config, index=index, master_address=master_address, token=token,
                                   host=host, port=port, api_key=api_key, listen_fd=listen_fd,
                                   served_model_name=served_model_name, jobs_dir=jobs_dir,
                                   control_api_key=control_api_key, control_routes=control_routes,
                                   limits=HttpLimits.from_dict(http_limits), max_model_len=max_model_len,
                                   tls=tls))
    except OSError as e:
        print(f"omni: frontend {index} cannot serve on {host}:{port}: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        print(f"omni: frontend {index} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
