"""Processes and sockets the bench starts, and how it always stops them.

Every process runs in its own session (so a Ctrl-C at the terminal reaches
only the bench, which then stops its children in order) and is stopped by the
context manager that started it: SIGTERM, a bounded wait, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent


def venv_bin(name: str) -> Path:
    """A console script next to the running interpreter (.venv/bin/<name>)."""
    return Path(sys.executable).parent / name


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_accepts(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class Managed:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    stop_seconds: float | None = None  # how long the first stop() took
    killed: bool = False  # needed SIGKILL after ignoring SIGTERM

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check_alive(self) -> None:
        rc = self.proc.poll()
        if rc is not None:
            raise RuntimeError(f"{self.name} exited with {rc}; see {self.log_path}:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_port(self, port: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if port_accepts(port):
                return
            time.sleep(0.02)
        raise TimeoutError(f"{self.name} did not accept on port {port} within {timeout}s")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            t0 = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"bench: {self.name} ignored SIGTERM {timeout}s, killing", file=sys.stderr)
                self.killed = True
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait(10)
            self.stop_seconds = time.monotonic() - t0
        return self.proc.returncode


@contextlib.contextmanager
def managed(
    name: str,
    cmd: list[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    stop_timeout: float = 30.0,
    cwd: Path | None = None,
) -> Iterator[Managed]:
    """Start ``cmd`` with stdout+stderr to ``log_path``; stop it on exit, whatever happens."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[bytes] = log_path.open("ab")
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd or REPO,
            start_new_session=True,
        )
    finally:
        log.close()  # the child holds its own copy
    m = Managed(name, proc, log_path)
    try:
        yield m
    finally:
        m.stop(stop_timeout)


def base_env(**extra: str) -> dict[str, str]:
    """The bench's environment minus anything that would change the service's behaviour."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TOKO_")
        and k
        not in {
            "NOTIFY_SOCKET",
            "WATCHDOG_USEC",
            "WATCHDOG_PID",
            "LISTEN_FDS",
            "LISTEN_PID",
            "LISTEN_FDNAMES",
            "JOURNAL_STREAM",
            "STATE_DIRECTORY",
            "CREDENTIALS_DIRECTORY",
        }
    }
    env.update(extra)
    return env


class NotifySocket:
    """A bound AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, str]] = []

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> NotifySocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for(self, key: str, timeout: float, proc: Managed | None = None) -> float:
        """Block until a datagram contains line ``key`` (e.g. ``READY=1``); monotonic arrival."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {key} on NOTIFY_SOCKET within {timeout}s")
            if proc is not None:
                proc.check_alive()
            self.sock.settimeout(min(left, 0.25))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            now = time.monotonic()
            text = data.decode(errors="replace")
            self.messages.append((now, text))
            if key in text.splitlines():
                return now


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of ``pid`` in KiB, from /proc/<pid>/status."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in {"VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads"}:
            out[key] = int(value.split()[0])
    return out


def install_sigterm_as_interrupt() -> None:
    """Make SIGTERM unwind like Ctrl-C, so every context manager stops its process."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (all its threads) so far, from /proc/<pid>/stat."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
