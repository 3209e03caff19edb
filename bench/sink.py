"""Running ``bench.smtp_sink`` as a child process and reading what it recorded."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Managed, managed


@dataclass(frozen=True)
class Sink:
    port: int
    proc: Managed

    @property
    def url(self) -> str:
        """The value for TOKO_SMTP_URL."""
        return f"smtp://127.0.0.1:{self.port}"


def read_record(path: Path) -> list[tuple[float, str, str]]:
    """The lines a sink wrote: (time, Message-ID, outcome); tolerates a torn last line."""
    rows: list[tuple[float, str, str]] = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        try:
            rows.append((float(parts[0]), parts[1], parts[2]))
        except ValueError:
            continue
    return rows


@contextlib.contextmanager
def smtp_sink(workdir: Path, name: str, delay: float, record: Path) -> Iterator[Sink]:
    """Run ``bench.smtp_sink`` (the tests' aiosmtpd server) in its own process; yield its port."""
    port_file = workdir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.smtp_sink", "--delay", str(delay)]
    cmd += ["--record", str(record), "--port-file", str(port_file)]
    with managed(name, cmd, log_path=workdir / f"{name}.log") as sink:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            sink.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not report its port")
            time.sleep(0.05)
        port = int(port_file.read_text())
        sink.wait_port(port)
        yield Sink(port, sink)
