"""Free TCP ports for configurations written before anything binds them (test clusters, benchmark servers, a
local Ray head).

Choosing ports one at a time (bind port 0, read it, close) can hand out the same port twice: the kernel may
give a just-released port to the next bind. `free_ports` keeps every socket bound until all of them are
chosen, so one call never repeats a port. Another process may still take a port before the caller binds it;
whoever binds reports that as an error of its own.
"""

from __future__ import annotations

import socket
from typing import Optional


def free_ports(n: int, host: str = "127.0.0.1", exclude: Optional[tuple[int, int]] = None) -> list[int]:
    """`n` distinct TCP ports on `host` ("" for every interface) that nothing listened on a moment ago.

    `exclude`: an inclusive (low, high) range of ports never to return (e.g. Ray's worker ports).
    Raises OSError when the host has no free port left."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if exclude is None or not exclude[0] <= port <= exclude[1]:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def free_port(host: str = "127.0.0.1", exclude: Optional[tuple[int, int]] = None) -> int:
    """One port of `free_ports`; a caller that needs several for one configuration asks for them at once."""
    return free_ports(1, host, exclude)[0]
