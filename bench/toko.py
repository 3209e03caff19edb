"""Starting toko-api (or a stand-in with the same interface) for a scenario."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.procs import REPO, Managed, base_env, free_port, managed


@dataclass(frozen=True)
class TokoCommand:
    """How to start toko-api: the venv's console script, or a snapshot of a git revision."""

    argv: list[str]
    cwd: Path | None = None  # a snapshot's directory, so ``python -m service`` imports it
    revision: str = "working tree"
    # The interpreter toko-api runs on: a baseline measured beside it runs on it too.
    python: str = sys.executable


@dataclass(frozen=True)
class Target:
    """A server under test: how to start it and where it listens."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    cwd: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def toko_target(
    toko: TokoCommand,
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
    return Target("toko-api", toko.argv, env, port, toko.cwd)


def baseline_target(python: str = sys.executable) -> Target:
    """The in-memory aiohttp baseline (bench.baseline_app): toko's HTTP work, no store.

    ``python`` needs only aiohttp, so the interpreter of a package-style venv will do.
    """
    port = free_port()
    cmd = [python, "-m", "bench.baseline_app", "--listen", f"127.0.0.1:{port}"]
    return Target("baseline", cmd, base_env(), port, REPO)


def snapshot(ref: str, dest: Path) -> TokoCommand:
    """Extract ``service/`` and ``jobs/`` at git ``ref`` into ``dest`` (read-only on the repo).

    Lets the bench measure a committed revision while the working tree is being
    edited, or compare two revisions. The venv's dependencies are used as they are.
    """
    rev = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev, "service", "jobs"],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return TokoCommand([sys.executable, "-m", "service"], cwd=dest, revision=rev)


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
        target.name,
        target.cmd,
        log_path=log_path,
        env=target.env,
        stop_timeout=stop_timeout,
        cwd=target.cwd,
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


def group_commit_factor(log: Path) -> dict[str, float] | None:
    """COMMITS and WRITES from toko-api's "store closed" line: writes sharing one fsync."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"store closed"' in line:
            try:
                rec = json.loads(line)
                commits, writes = int(rec["COMMITS"]), int(rec["WRITES"])
            except (ValueError, KeyError, TypeError):
                return None
            return {
                "commits": commits,
                "writes": writes,
                "writes_per_commit": round(writes / commits, 2) if commits else 0.0,
            }
    return None
