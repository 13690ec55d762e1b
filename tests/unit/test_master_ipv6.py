"""A master on an IPv6 host: its address is [HOST]:PORT, which gRPC and omni's own checks read; joined bare
(`::1:PORT`) the master could not listen ("cannot listen on ::1:0") and a client dialled port 443."""

from __future__ import annotations

import socket

import pytest

from omni.master.client import MasterClient, check_address
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from omni.netaddr import host_port

CFG = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}]}


@pytest.mark.parametrize("host,want", [("::1", "[::1]:5"), ("[::1]", "[::1]:5"), ("127.0.0.1", "127.0.0.1:5"),
                                       ("localhost", "localhost:5")])
def test_host_port_brackets_ipv6_once(host, want):
    assert host_port(host, 5) == want


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")


@needs_ipv6
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_a_master_on_ipv6_loopback_listens_and_answers(host):
    server = MasterServer(CFG, hash_config(CFG), host=host, port=0)
    server.start()
    try:
        assert server.address.startswith("[::1]:")
        assert check_address(server.address) == server.address
        client = MasterClient(server.address)
        try:
            assert client.get_status(timeout_s=10).config_hash == hash_config(CFG)
        finally:
            client.close()
    finally:
        server.stop()
