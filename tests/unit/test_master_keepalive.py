"""The master lets its clients ping idle connections (omni/master/limits.KEEPALIVE_MS): with gRPC's
server defaults a client pinging with no call open got a GOAWAY "too_many_pings" and its next call
could fail (seen once in a soak: `omni status`-style client idle for 30 s)."""

from __future__ import annotations

import threading

import grpc
import pytest

from omni._proto import master_pb2 as pb
from omni._proto import master_pb2_grpc as pb_grpc
from omni.master import limits
from omni.master.server import MasterServer


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(limits, "KEEPALIVE_MS", 500)    # the server reads it when it starts
    srv = MasterServer()
    srv.start()
    yield srv
    srv.stop()


def test_an_idle_client_pinging_at_the_keepalive_period_keeps_its_connection(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[
        ("grpc.keepalive_time_ms", limits.KEEPALIVE_MS), ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0)])      # ping on, however long the connection idles
    try:
        pb_grpc.MasterStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        lost = threading.Event()
        channel.subscribe(lambda s: s is not grpc.ChannelConnectivity.READY and lost.set())
        idle_s = 12 * limits.KEEPALIVE_MS / 1000          # 12 pings with no call open (gRPC's default server
                                                          # answered within ~3 s with a GOAWAY)
        # the idle time is the scenario itself; a GOAWAY ends the wait at once
        assert not lost.wait(idle_s), "the master dropped an idle client's connection (too_many_pings)"
    finally:
        channel.close()


def test_the_clients_period_is_one_the_master_allows():
    from omni.master.server import server_options

    opts = dict(server_options())
    assert opts["grpc.keepalive_permit_without_calls"] == 1
    assert opts["grpc.http2.min_ping_interval_without_data_ms"] <= limits.KEEPALIVE_MS
