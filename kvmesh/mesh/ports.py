"""Free TCP ports on loopback, chosen by the OS, never inside ranges other software owns."""

from __future__ import annotations

import socket
from contextlib import ExitStack

from kvmesh.errors import PortError

# Mooncake's transfer engine binds inside this range (inclusive); never hand one of these out.
RESERVED_RANGES: tuple[tuple[int, int], ...] = ((12300, 17000),)
_MAX_TRIES = 200


def is_reserved(port: int) -> bool:
    return any(lo <= port <= hi for lo, hi in RESERVED_RANGES)


def _bind_ephemeral(host: str) -> socket.socket:
    """A socket bound to an OS-chosen port on `host` (not listening)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports. Every socket stays bound until all are picked, so none repeats."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    picked: list[int] = []
    with ExitStack() as held:
        for _ in range(_MAX_TRIES + n):
            if len(picked) == n:
                return picked
            sock = held.enter_context(_bind_ephemeral(host))
            port = sock.getsockname()[1]
            if not is_reserved(port) and port not in picked:
                picked.append(port)
        if len(picked) == n:
            return picked
    raise PortError(f"could not find {n} free ports on {host} outside {RESERVED_RANGES}")


def free_port(host: str = "127.0.0.1") -> int:
    """One free port (bind port 0, read it, close). Another process may still take it later."""
    return free_ports(1, host)[0]
