"""A ZMQ stage channel that closes still delivers what was posted last (the Aborts of requests
failed or moved off a replica going SUSPECT, or of every request at shutdown) for up to
CLOSE_LINGER_MS: a replica whose connection is down for a moment gets them once it is back.
With LINGER 0 they were dropped and the stage kept those requests (streams) open for good."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from omni.orchestrator.channel import CLOSE_LINGER_MS, StageChannel
from omni.stage import messages as m


def test_aborts_posted_just_before_close_reach_a_replica_that_is_back_within_the_linger(tmp_path):
    endpoint = f"ipc://{tmp_path}/stage"

    async def go() -> list:
        ctx = zmq.asyncio.Context()
        ch = StageChannel(ctx, endpoint=endpoint, frontend_id="fe-test", replica_id="s0r0", stage_id=0, token="",
                          on_message=lambda c, msg: None)
        ch.start()                                  # its Hello
        ch.post(m.Abort(["r1", "r1/s1"]))
        ch.close()                                  # nothing listens yet: both wait in ZMQ's queue
        stage_ctx = zmq.Context()
        router = stage_ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)                       # the replica is back (a reconnect: at most 100 ms)
        codec, got = m.Codec(m.ToStage), []
        deadline = time.monotonic() + CLOSE_LINGER_MS / 1000
        try:
            while len(got) < 2 and time.monotonic() < deadline:
                if await asyncio.to_thread(router.poll, 50):
                    got.append(codec.decode(router.recv_multipart()[1]))
        finally:
            router.close()
            stage_ctx.term()
            ctx.term()
        return got

    got = asyncio.run(go())
    assert [type(x) for x in got] == [m.Hello, m.Abort] and got[1].request_ids == ["r1", "r1/s1"]
