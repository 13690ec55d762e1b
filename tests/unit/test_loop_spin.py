"""LoopSpin (omni/orchestrator/local_channel.py): the frontend loop polls without waiting for a
bounded time after stage traffic, then goes back to sleeping; it never spins on by itself."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from omni.orchestrator.local_channel import LoopSpin


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_the_spin_ends_after_its_window_and_io_is_served_during_it(new_loop):
    loop = new_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        async def run() -> None:
            turns = 0
            spin = LoopSpin(loop, 0.02)
            original = spin._turn

            def counted() -> None:
                nonlocal turns
                turns += 1
                original()
            spin._turn = counted
            got = loop.create_future()
            loop.add_reader(a.fileno(), lambda: got.done() or got.set_result(a.recv(16)))
            spin.extend()
            b.send(b"ping")                       # read by the spinning loop, as by a sleeping one
            assert await asyncio.wait_for(got, 10) == b"ping"
            loop.remove_reader(a.fileno())
            while spin._queued:                   # it ends by itself: no perpetual busy loop
                await asyncio.sleep(0.005)
            assert turns > 1                      # it did turn the loop meanwhile
            settled = turns
            await asyncio.sleep(0.05)
            assert turns == settled               # and nothing turns it after the window
            off = LoopSpin(loop, 0.0)
            off.extend()
            assert not off._queued                # OMNI_SPIN_US=0: no callback at all

        loop.run_until_complete(asyncio.wait_for(run(), 30))
    finally:
        a.close()
        b.close()
        loop.close()
