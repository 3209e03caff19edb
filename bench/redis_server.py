"""A throwaway Redis server for the arq comparison, always stopped.

Debian's ``redis-server`` on 127.0.0.1 and a free port, working directory a
fresh temporary folder, persistence off (``--save ''``, ``--appendonly no``:
how arq is usually deployed, and the figures say so: unlike toko's commits,
an enqueue here is not on disk when it returns).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Managed, free_port, managed

DEBIAN_PACKAGE = "redis-server"


@dataclass(frozen=True)
class RedisServer:
    port: int
    proc: Managed

    @property
    def target(self) -> dict[str, int]:
        return {"port": self.port}


def redis_command(binary: str, port: int, directory: Path) -> list[str]:
    return [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(directory),
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--protected-mode",
        "yes",
        "--loglevel",
        "warning",
    ]


@contextlib.contextmanager
def redis_server(log_path: Path) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(f"redis-server not found: apt-get install {DEBIAN_PACKAGE}")
    directory = Path(tempfile.mkdtemp(prefix="toko-bench-redis-"))
    port = free_port()
    try:
        command = redis_command(binary, port, directory)
        with managed("redis-server", command, log_path=log_path) as p:
            p.wait_port(port)
            yield RedisServer(port, p)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def flush_redis(port: int) -> None:
    """Empty the server on ``port`` between measurements."""
    import redis  # the bench extra only (arq's client)

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        client.flushall()
    finally:
        client.close()
