"""The small pieces multi-host serving relies on: the advertised address and the
per-transport tensor byte counts (the e2e test is tests/e2e/test_multihost.py; IPv6:
tests/unit/test_data_plane_ipv6.py)."""

from __future__ import annotations

import pytest

from omni.orchestrator.metrics import OrchestratorMetrics
from omni.stage.main import advertised_host, default_advertise_host


def test_a_concrete_bind_address_is_advertised_as_is():
    assert advertised_host("10.1.2.3", "10.9.9.9:50051") == "10.1.2.3"
    assert advertised_host("127.0.0.1", "10.9.9.9:50051") == "127.0.0.1"
    # --host [::1] is the host ::1, as stages register theirs (same host: shared memory, not tcp)
    assert advertised_host("[::1]", "[::1]:50051") == advertised_host("::1", "[::1]:50051") == "::1"


def test_a_wildcard_bind_advertises_the_route_to_the_master():
    assert advertised_host("0.0.0.0", "127.0.0.1:50051") == "127.0.0.1"
    assert advertised_host("::", "localhost:50051") == "127.0.0.1"
    # 127.0.0.2 is not one of the named local hosts: the UDP route lookup answers.
    assert advertised_host("0.0.0.0", "127.0.0.2:50051") == default_advertise_host("127.0.0.2:50051")
    assert default_advertise_host("127.0.0.2:50051").startswith("127.")


@pytest.mark.parametrize("bind", ["[::]", "0", "0:0::0"])
def test_every_spelling_of_a_wildcard_bind_advertises_the_route_to_the_master(bind):
    assert advertised_host(bind, "127.0.0.1:50051") == "127.0.0.1"    # "[::]" was advertised as itself


def test_tensor_bytes_are_counted_per_transport():
    m = OrchestratorMetrics()
    m.tensor_bytes(100, "shm")
    m.tensor_bytes(40, "tcp")
    m.tensor_bytes(1, "shm")
    text = m.render("fe0")
    assert 'omni_tensor_bytes_total{frontend="fe0",transport="shm"} 101' in text
    assert 'omni_tensor_bytes_total{frontend="fe0",transport="tcp"} 40' in text
    assert m.tensor_bytes_total == 141
