"""TCP ports for the servers the tests start (toko-api, PostgreSQL, a container's socket).

A port is picked here and bound later by another process. Picked from the
kernel's ephemeral range, as ``bind(("127.0.0.1", 0))`` does, it could be
given in between to a client socket as its source port (the tests open many
connections on 127.0.0.1), and the server's bind would then fail. So the
ports come from below that range, where the kernel never picks one, and no
two calls in one test session get the same port.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOWEST = 10_000
_lock = threading.Lock()
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that nothing but its caller will pick."""
    highest = _ephemeral_start() - 1
    with _lock:
        # At random: other test runs on the machine pick elsewhere. Thousands
        # of ports are free in that range; a few tries find one.
        for _ in range(1000):
            port = random.randint(LOWEST, highest)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    raise OSError("no free TCP port on 127.0.0.1 below the ephemeral range")


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
