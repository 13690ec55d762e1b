"""Host and port joined for gRPC targets, listeners and transport endpoints; whether a host is IPv6."""

from __future__ import annotations

import ipaddress


def bracketed(host: str) -> str:
    """An IPv6 host in brackets (given with or without them), any other as it is: what goes before `:PORT`."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


def host_port(host: str, port: int) -> str:
    """HOST:PORT with an IPv6 host in brackets (given with or without them): gRPC reads a bare `::1:5000`
    as host `::1:5000` on port 443."""
    return f"{bracketed(host)}:{port}"


def endpoint_host(endpoint: str) -> str:
    """The host of `HOST:PORT` or `tcp://HOST:PORT`, brackets off."""
    return endpoint.rpartition("://")[2].rpartition(":")[0].strip("[]")


def is_ip(host: str) -> bool:
    """An IPv4 or IPv6 address (no brackets, no zone); a name is not."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_ipv6(host: str) -> bool:
    """An IPv6 address, bracketed or not, a zone (`%eth0`) allowed; a name or IPv4 address is not."""
    try:
        return ipaddress.ip_address(host.strip("[]").partition("%")[0]).version == 6
    except ValueError:
        return False


def is_loopback_ip(address: str) -> bool:
    """127.0.0.0/8, ::1, or a dual-stack socket's ::ffff:127.x (a zone allowed); a name is not."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
