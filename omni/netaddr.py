"""Host and port joined for gRPC targets, listeners and transport endpoints; whether a host is IPv6."""

from __future__ import annotations

import ipaddress


def host_port(host: str, port: int) -> str:
    """HOST:PORT with an IPv6 host in brackets (given with or without them): gRPC reads a bare `::1:5000`
    as host `::1:5000` on port 443."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ipv6(host: str) -> bool:
    """An IPv6 address, bracketed or not, a zone (`%eth0`) allowed; a name or IPv4 address is not."""
    try:
        return ipaddress.ip_address(host.strip("[]").partition("%")[0]).version == 6
    except ValueError:
        return False
