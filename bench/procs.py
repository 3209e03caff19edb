"""Processes and sockets the bench starts, and how it always stops them.

Every process runs in its own session (so a Ctrl-C at the terminal reaches
only the bench, which then stops its children in order) and is stopped by the
context manager that started it: SIGTERM, a bounded wait, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
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

    def dump_stacks(self) -> Path | None:
        """Every thread's Python stack (py-spy dump) into ``<log>.stacks``, for a
        process that hangs; None when py-spy is missing or could not read it."""
        spy = venv_bin("py-spy")
        if not spy.exists():
            return None
        out = self.log_path.with_name(self.log_path.name + ".stacks")
        try:
            with out.open("wb") as f:
                done = subprocess.run(
                    [str(spy), "dump", "--pid", str(self.pid)],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=20,
                    check=False,
                )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out if done.returncode == 0 else None

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
                stacks = self.dump_stacks()
                print(
                    f"bench: {self.name} ignored SIGTERM {timeout}s, killing"
                    + (f"; its threads' stacks are in {stacks}" if stacks else ""),
                    file=sys.stderr,
                )
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


def _machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores), from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest is already in user


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far: the whole machine (busy), one process, and reaped children."""

    at: float
    machine_busy_s: float
    process_s: float
    children_s: float
    self_s: float


def cpu_snapshot(pid: int) -> CpuSnapshot:
    busy = _machine_busy_s()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return CpuSnapshot(
        at=time.monotonic(),
        machine_busy_s=busy,
        process_s=cpu_seconds(pid),
        children_s=children.ru_utime + children.ru_stime,
        self_s=me.ru_utime + me.ru_stime,
    )


def cpu_usage(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """Percent of one core used by the server, reaped children (wrk), the bench, and the rest.

    ``others_pct`` is what other users of this shared machine took meanwhile:
    the noise indicator of a run.
    """
    wall = max(after.at - before.at, 1e-9)

    def pct(a: float, b: float) -> float:
        return (b - a) / wall * 100

    server = pct(before.process_s, after.process_s)
    children = pct(before.children_s, after.children_s)
    me = pct(before.self_s, after.self_s)
    machine = pct(before.machine_busy_s, after.machine_busy_s)
    return {
        "server_pct": round(server, 1),
        "children_pct": round(children, 1),
        "bench_pct": round(me, 1),
        "machine_pct": round(machine, 1),
        "others_pct": round(max(0.0, machine - server - children - me), 1),
        "cores": float(os.cpu_count() or 1),
    }


def fsync_probe(directory: Path, count: int = 50) -> dict[str, float]:
    """fsync latency of 4 KiB appends in ``directory``: what a durable commit waits for."""
    path = directory / ".fsync-probe"
    times: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(count):
            os.write(fd, b"x" * 4096)
            t0 = time.perf_counter()
            os.fsync(fd)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    times.sort()
    return {
        "p50_ms": round(times[len(times) // 2], 3),
        "p90_ms": round(times[int(len(times) * 0.9)], 3),
        "max_ms": round(times[-1], 3),
    }


def cpu_probe(rounds: int = 5, iterations: int = 20000) -> dict[str, float]:
    """µs per iteration of a fixed, single-threaded Python workload (a JSON body
    parsed and answered, as a request's own work is): the median of ``rounds``.
    It shows which kind of machine a run had (docs/benchmarks.md)."""
    body = '{"nama": "Teh Hijau", "harga": 15000}'
    per_round: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(iterations):
            data = json.loads(body)
            json.dumps({"id": i, "nama": str(data["nama"]), "harga": int(data["harga"])})
        per_round.append((time.perf_counter() - t0) / iterations * 1e6)
    per_round.sort()
    return {
        "median_us": round(per_round[len(per_round) // 2], 3),
        "min_us": round(per_round[0], 3),
        "max_us": round(per_round[-1], 3),
    }


class FsyncMonitor:
    """A thread that times one 4 KiB write+fsync every ``interval`` s, in the DB's directory.

    While a load runs, it shows when the disk itself was slow (other tenants'
    I/O), which is when durable commits, and so POST latency, must be slow too.
    """

    def __init__(self, directory: Path, interval: float = 0.05) -> None:
        self.path = directory / ".fsync-monitor"
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (monotonic start, ms)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fsync-monitor", daemon=True)

    def __enter__(self) -> FsyncMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while not self._stop.wait(self.interval):
                os.write(fd, b"x" * 4096)
                t0 = time.monotonic()
                os.fsync(fd)
                self.samples.append((t0, (time.monotonic() - t0) * 1000))
        finally:
            os.close(fd)


def machine_busy_pct(window: float = 1.0) -> float:
    """Percent of one core the whole machine used over ``window`` seconds."""
    b0, t0 = _machine_busy_s(), time.monotonic()
    time.sleep(window)
    return (_machine_busy_s() - b0) / (time.monotonic() - t0) * 100


def wait_for_quiet(threshold_pct: float, max_wait_s: float) -> dict[str, float]:
    """Wait (bounded) until the machine is quieter than ``threshold_pct`` of one core.

    Called between measurements, when none of the bench's servers runs, so
    what it sees is other tenants. Returns what it saw and how long it waited.
    """
    t0 = time.monotonic()
    level = machine_busy_pct()
    while level > threshold_pct and time.monotonic() - t0 < max_wait_s:
        level = machine_busy_pct()
    return {"busy_pct": round(level, 1), "waited_s": round(time.monotonic() - t0, 1)}


def remove_sqlite(path: Path) -> None:
    """Delete a SQLite database with its write-ahead log and index, if there."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
