"""A datagram socket standing in for journald's, and what tests do with it."""

from __future__ import annotations

import contextlib
import socket


def fill(journald: socket.socket) -> int:
    """journald's queue full, as when it stopped reading a while ago: how many
    entries another program put there."""
    sent = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other_program:
        other_program.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                other_program.sendto(b"MESSAGE=other", journald.getsockname())
                sent += 1
    return sent
