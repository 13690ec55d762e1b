"""Jobs and a sleep with mode=wait: a job accepted before the hold (queued behind the running ones too) is in
flight, so the wait lets it finish; one submitted during the hold is refused at once (503), not accepted and
failed later. The wait counted only requests running in the pipeline: a queued job then started into the
gate and failed."""

from __future__ import annotations

import asyncio
import threading

import pytest

from omni.api.jobs import MAX_RUNNING, LocalKv
from omni.orchestrator import quiesce
from tests.unit.api_fakes import FakeOrchestrator, chat_body, tokenizer  # noqa: F401
from tests.unit.test_jobs import frontend, settle

pytestmark = pytest.mark.anyio


async def test_jobs_accepted_before_the_hold_finish_and_new_ones_are_refused(tokenizer, tmp_path):  # noqa: F811
    orch, jobs, c = frontend(tokenizer, LocalKv(), tmp_path)
    gate = quiesce.Gate(loop=asyncio.get_running_loop())
    jobs.admit = gate.check
    running, release = [0], asyncio.Event()

    async def generate(req):            # as Orchestrator.generate: the gate's check, then in flight
        gate.check()
        running[0] += 1
        try:
            await release.wait()
            async for out in FakeOrchestrator.generate(orch, req):
                yield out
        finally:
            running[0] -= 1

    orch.generate = generate
    ids = []
    for _ in range(MAX_RUNNING + 1):     # the last one queued behind the running ones
        r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()})
        ids.append(r.json()["id"])
    ack: dict = {}
    held = threading.Thread(target=lambda: ack.update(v=gate.on_quiesce(
        {"hold_s": 30.0, "wait_s": 10.0, "token": "t"}, lambda: running[0] + jobs.unfinished)))
    held.start()
    while not gate.closed():
        await asyncio.sleep(0.01)       # the keep-alive thread's hold goes up (bounded: the thread's wait)
    r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()})
    assert r.status_code == 503 and "going to sleep" in r.json()["error"]["message"], r.text
    release.set()
    await settle(jobs)
    while held.is_alive():
        await asyncio.sleep(0.01)
    assert ack["v"] == (True, "no request in flight")
    statuses = [(await c.get(f"/v1/omni/jobs/{i}")).json() for i in ids]
    assert [s["status"] for s in statuses] == ["completed"] * len(ids), statuses
