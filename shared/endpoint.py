"""TCP endpoints as processes announce them to each other: "tcp://host:port"."""

from __future__ import annotations


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """"tcp://host:port" → (host, port); ValueError for anything else."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp:// endpoint: {endpoint!r}")
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a tcp://host:port endpoint: {endpoint!r}")
    return host.strip("[]"), int(port)


def tcp_endpoint(host: str, port: int) -> str:
    """(host, port) → "tcp://host:port" (an IPv6 address in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
