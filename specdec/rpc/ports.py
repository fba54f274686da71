"""Picking a loopback port for a process that binds it later."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
_rng = random.SystemRandom()  # not `random`: tests seed it, and xdist workers would pick alike
# The ports this process handed out last, oldest first: free when picked, but held by nobody
# until the process they were for binds them, so a second pick may not take one (`free_port`).
_picked: dict[int, None] = {}
_REMEMBERED = 4_096


def _ephemeral_floor() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port() -> int:
    """A loopback port nothing holds now, chosen below the kernel's ephemeral range.

    The port is bound seconds later by another process (a service that first loads its model).
    Ports the kernel hands out itself (every outgoing connection, gloo's pairs between
    tensor-parallel ranks, any bind to port 0) come from the ephemeral range, so one of those
    could take a port that bind(0) had picked for us in the meantime, a tensor-parallel
    target's own ranks' connections included. Below the range only another picker can
    collide, a port in use now is skipped, and so is one this process handed out before: a
    benchmark starts a dozen coordinators at once, none bound when the next port is picked,
    and two of them drew the same port (a coordinator that could not listen, in CI)."""
    floor = _ephemeral_floor()
    if floor - _LOWEST >= 1_000:
        for _ in range(100):
            port = _rng.randrange(_LOWEST, floor)
            if port in _picked:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                _picked[port] = None
                if len(_picked) > _REMEMBERED:
                    del _picked[next(iter(_picked))]
                return port
    with socket.socket() as sock:  # an unusual range: the kernel's own pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
