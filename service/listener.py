"""The listening sockets: socket activation or our own, and a shutdown that drops nobody.

Under socket activation systemd keeps the listening socket across restarts,
so connections wait in its queue while toko-api restarts. What this module
guards is the edge: connections this process already accepted when SIGTERM
came must still get their answer.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time

from aiohttp import web

from service.keys import HTTP_STATE
from service.settings import Settings
from service.systemd import passed_listen_sockets

log = logging.getLogger("toko.listener")

# asyncio calls listen() again on the socket it serves: keep the socket unit's
# Backlog=1024 rather than aiohttp's 128.
LISTEN_BACKLOG = 1024
# asyncio finishes an accepted connection in a task that needs the server still
# open; closing it first drops that connection unanswered (a reset). So stop
# reading the listening socket, let those tasks run, and only then close.
ACCEPT_SETTLE_SECONDS = 0.1
# Then connections accepted before get this long to send their request.
ACCEPTED_GRACE_SECONDS = 1.0
# The kernel's default ceiling (fs.nr_open), used when the hard limit is "unlimited".
OPEN_FILES_CEILING = 1 << 20


def raise_open_files_limit() -> int:
    """Lift the soft limit on open files to the hard one; return the soft limit in force.

    Each connection is a file, and systemd starts services at 1024, a default
    kept for select(). asyncio uses epoll, which has no such bound, and
    systemd.exec(5) asks such programs to raise the soft limit themselves.
    It matters beyond capacity: at the limit, Python 3.11's accept loop logs
    an error and schedules a retry once per backlog slot, and those retries
    multiply, flooding the log until files free up (CPython gh-151615).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return soft  # a sandbox that refuses: keep what we were given
        return wanted
    return soft


def listening_sockets(settings: Settings) -> tuple[list[socket.socket], str]:
    """The sockets to serve on and a description for the log."""
    passed = passed_listen_sockets()
    if passed:
        names = ", ".join(str(sock.getsockname()) for sock in passed)
        if settings.http.listen_given:
            # The installed units listen through toko-api.socket: an address in
            # toko.env would otherwise look applied, and be ignored without a word.
            log.warning(
                "TOKO_LISTEN is ignored: systemd passed the socket to listen on (%s);"
                " change that with systemctl edit toko-api.socket",
                names,
            )
        return passed, f"{names} (socket activation)"
    host, port = settings.http.host, settings.http.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    return [sock], f"{host}:{port}"


async def start_serving(runner: web.AppRunner, sockets: list[socket.socket]) -> None:
    for sock in sockets:
        await web.SockSite(runner, sock, backlog=LISTEN_BACKLOG).start()


async def stop_accepting(
    app: web.Application, runner: web.AppRunner, sockets: list[socket.socket]
) -> None:
    """Stop accepting, then let connections already accepted deliver their request.

    Answers from now on say "Connection: close", so each connection goes away
    as soon as it is served and the wait below usually ends early.
    """
    app[HTTP_STATE].draining = True
    loop = asyncio.get_running_loop()
    for sock in sockets:
        loop.remove_reader(sock.fileno())
    await asyncio.sleep(ACCEPT_SETTLE_SECONDS)
    for site in list(runner.sites):
        await site.stop()  # closes our copy of the socket; systemd keeps its own
    server = runner.server
    deadline = time.monotonic() + ACCEPTED_GRACE_SECONDS
    # aiohttp has no event for a closed connection, so look a few times.
    while server is not None and server.connections and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
