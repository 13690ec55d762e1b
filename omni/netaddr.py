"""Host and port joined for gRPC targets, listeners and transport endpoints."""

from __future__ import annotations


def host_port(host: str, port: int) -> str:
    """HOST:PORT with an IPv6 host in brackets (given with or without them): gRPC reads a bare `::1:5000`
    as host `::1:5000` on port 443."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
