"""A frontend's /health says whether it serves: while the omni master is away (a restart) it serves from the
last topology the master sent, so /health stays 200 (a load balancer or liveness probe would otherwise drop
or restart every frontend at once) and says the master is away beside "healthy"; /metrics has it as a gauge.
Before the first topology, or with a stage that has no READY replica, it is 503."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

from omni.api.admin import AdminRoutes
from omni.engines.base import SamplingParams
from omni.frontend import follow_topology
from omni.master.client import AsyncMasterClient, MasterClient
from omni.master.server import MasterServer
from omni.master.types import TopologyEvent
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.stage.worker import StageWorker
from tests.unit.test_orchestrator_replay import CONFIG, info
from tests.unit.test_stage_worker import CountEngine


class FE:   # the part of FrontendState that AdminRoutes' health reads
    def __init__(self, orch):
        self.orch = orch


def health(orch) -> tuple[int, dict]:
    admin = AdminRoutes.__new__(AdminRoutes)
    admin.fe = FE(orch)
    status, body = admin._health()
    return status, json.loads(body)


async def until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)   # polling local state, bounded


@pytest.fixture
def deployment():
    """A real in-process master, and a stage worker registered with it."""
    cfg, h = CONFIG.to_dict(), CONFIG.config_hash()
    master = MasterServer(cfg, h, lease_ttl_s=1.5)
    port = master.start()
    w = StageWorker(CONFIG.stage(0), CountEngine(), replica_id="s0r0")
    t = threading.Thread(target=w.run, kwargs={"grace_s": 0.5}, daemon=True)
    t.start()
    sc = MasterClient(f"127.0.0.1:{port}")
    reg = sc.register("STAGE", 0, config_hash=h, pipeline_config=cfg, endpoints={"channel": w.endpoint},
                      host="127.0.0.1")
    w.replica_id = reg.replica_id
    sc.start_keepalive(w.load, lambda c: (True, ""), interval_s=0.3)
    try:
        yield master, port
    finally:
        sc.close()
        w.stop()
        t.join(10)
        master.stop()


def test_health_stays_ok_while_the_master_is_away_and_requests_are_served(deployment):
    """Before: 503 "no topology from the omni master yet" as soon as the watch broke, though the request
    below was served."""
    master, port = deployment

    async def go():
        topo = Topology(grace_s=1.5)
        am = AsyncMasterClient(f"127.0.0.1:{port}")
        stop = asyncio.Event()
        watch = asyncio.create_task(follow_topology(am, topo, stop))
        orch = Orchestrator(CONFIG, frontend_id="fe0-x", topology=topo, detokenize=str, master=am)

        async def one():
            req = PipelineRequest(request_id=uuid.uuid4().hex, prompt_token_ids=[1], modalities=("text",),
                                  sampling=SamplingParams(max_tokens=3))
            return [o.token_ids async for o in orch.generate(req)]

        try:
            await until(lambda: orch.health()[0], "healthy with the master up")
            assert health(orch) == (200, {"status": "healthy"})
            up = orch.metrics_text()
            await asyncio.to_thread(master.stop)
            await until(lambda: orch.health() != (True, "ok"), "the watch sees the master gone")
            assert health(orch) == (200, {"status": "healthy", "reason": "omni master unreachable: serving from "
                                                                         "the last topology it sent"})
            assert await one() == [[2], [3], [4]]
            assert 'omni_master_connected{frontend="fe0-x"} 1' in up
            assert 'omni_master_connected{frontend="fe0-x"} 0' in orch.metrics_text()
        finally:
            stop.set()
            watch.cancel()
            await orch.close()
            await am.close()

    asyncio.run(go())


def test_health_is_503_before_the_first_topology_and_without_a_ready_replica():
    topo = Topology()
    orch = Orchestrator(CONFIG, frontend_id="fe0-x", topology=topo, detokenize=str)
    try:
        assert health(orch) == (503, {"status": "unhealthy", "reason": "no topology from the omni master yet"})
        replica = info(SimpleNamespace(endpoint="tcp://127.0.0.1:1"), "s0r0", state="DRAINING")
        topo.apply(TopologyEvent(kind="SNAPSHOT", replicas=[replica], seq=1))
        topo.connected = False   # the master away: the last topology it sent still decides
        status, body = health(orch)
        assert status == 503 and body["reason"].startswith("no READY replica for stage 0")
        assert "omni master unreachable" in body["reason"]
    finally:
        asyncio.run(orch.close())
