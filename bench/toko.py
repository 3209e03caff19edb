"""Starting toko-api (or a stand-in with the same interface) for a scenario."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Managed, base_env, free_port, managed


@dataclass(frozen=True)
class Target:
    """A server under test: how to start it and where it listens."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def toko_target(
    cmd: list[str],
    database: Path,
    *,
    workers: int = 3,
    smtp_url: str | None = None,
    notify_socket: Path | None = None,
    port: int | None = None,
    log_level: str = "info",
    extra_env: dict[str, str] | None = None,
) -> Target:
    port = port or free_port()
    env = base_env(
        TOKO_LISTEN=f"127.0.0.1:{port}",
        TOKO_DATABASE=str(database),
        TOKO_WORKERS=str(workers),
        TOKO_LOG_LEVEL=log_level,
    )
    if smtp_url:
        env["TOKO_SMTP_URL"] = smtp_url
    if notify_socket is not None:
        env["NOTIFY_SOCKET"] = str(notify_socket)
    env.update(extra_env or {})
    return Target("toko-api", cmd, env, port)


def get_json(url: str, timeout: float = 5.0) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@contextlib.contextmanager
def running(
    target: Target, log_path: Path, *, ready_timeout: float = 30.0, stop_timeout: float = 30.0
) -> Iterator[Managed]:
    """Start ``target``, wait until its port accepts and /healthz says 200; stop it on exit."""
    with managed(
        target.name, target.cmd, log_path=log_path, env=target.env, stop_timeout=stop_timeout
    ) as proc:
        proc.wait_port(target.port, ready_timeout)
        deadline = time.monotonic() + ready_timeout
        while True:
            proc.check_alive()
            try:
                status, _ = get_json(target.base_url + "/healthz")
            except (OSError, ValueError):
                status = 0
            if status == 200:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target.name} /healthz not 200 within {ready_timeout}s")
            time.sleep(0.05)
        yield proc
