"""What the disk scenario watches beside the load: the filesystem, the WAL, CPU.

- ``describe_filesystem``: which mount holds a folder (/proc/mounts) and
  statfs's type name, so a tmpfs cannot pass for a disk.
- ``RunSampler``: a thread in the bench's otherwise idle main process that
  every ``interval`` s records the size of ``toko.db-wal``, the write-ahead
  log's index header from ``toko.db-shm`` (frames in use since the log last
  restarted, how many of them checkpoints have copied into the database, and
  its salt, which changes at every restart), and cumulative CPU seconds of the
  whole machine, of toko-api, of the bench's own process tree and of a
  PostgreSQL server's processes. Consecutive ticks give the CPU other
  tenants used in any window, and when checkpoints ran. Of toko-api's threads
  it also records, from each one's ``/proc/<pid>/task/<tid>/schedstat``, the
  time they ran and the time they were ready but waited for a core (the
  scheduler's run queue): the event loop's thread apart, the others (the
  SQLite writer, its checkpointer, readers) summed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import struct
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs"})
WAL_INDEX_VERSION = 3007000
MIB = 1024 * 1024


def _unescape_mount(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_of(path: str, mounts: str) -> dict[str, str]:
    """The mount holding absolute ``path``: the longest mount point that contains it.

    ``mounts`` is /proc/mounts' text; of several mounts on one point the last wins
    (it is the one on top).
    """
    best: dict[str, str] = {"mount_point": "", "fstype": "unknown", "device": "unknown"}
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        device, point, fstype = _unescape_mount(fields[0]), _unescape_mount(fields[1]), fields[2]
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best["mount_point"]):
            best = {"mount_point": point, "fstype": fstype, "device": device}
    return best


def describe_filesystem(directory: Path) -> dict[str, str]:
    """/proc/mounts' entry for ``directory``, and statfs's type name as a cross-check."""
    real = os.path.realpath(directory)
    try:
        fs = filesystem_of(real, Path("/proc/mounts").read_text())
    except OSError:
        fs = {"mount_point": "", "fstype": "unknown", "device": "unknown"}
    try:
        # statfs's f_type, which os.statvfs does not expose (ext2/3/4 share one magic).
        out = subprocess.run(
            ["stat", "-f", "-c", "%T", real], capture_output=True, text=True, timeout=10
        )
        fs["statfs_type"] = out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        fs["statfs_type"] = "unknown"
    fs["path"] = real
    return fs


@dataclass(frozen=True)
class WalIndex:
    page_size: int
    frames: int  # mxFrame: frames in the log since it last restarted
    backfilled: int  # nBackfill: of those, copied into the database by checkpoints
    salt: bytes  # new at every restart of the log

    @property
    def frame_bytes(self) -> int:
        return self.page_size + 24


def parse_wal_index(header: bytes) -> WalIndex | None:
    """The wal-index header at the start of a ``-shm`` file (SQLite's wal.c), or None.

    The header is written twice; a read between the two writes (the copies
    differ), an uninitialised index or another format gives None. Native byte
    order: the index is shared memory, never moved between machines.
    """
    if len(header) < 100:
        return None
    version, _, _, is_init, _, page, frames = struct.unpack_from("=IIIBBHI", header, 0)
    if version != WAL_INDEX_VERSION or not is_init or header[:48] != header[48:96]:
        return None
    (backfilled,) = struct.unpack_from("=I", header, 96)
    return WalIndex(65536 if page == 1 else page, frames, backfilled, header[32:40])


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """``root`` and every process below it, from a pid -> parent pid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found = {root} if root in parents else set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cpu_times(stat_line: str, ticks_per_s: float) -> tuple[float, float, float]:
    """(busy, interrupts, steal) CPU seconds of the whole machine from /proc/stat's first line.

    Busy is everything but idle and iowait; interrupts (irq + softirq, where the
    loopback's packets are handled) and steal (the hypervisor running other
    guests) are charged to no process, so they are kept apart.
    """
    v = [int(x) for x in stat_line.split()[1:]] + [0] * 8
    idle = v[3] + v[4]
    return (sum(v[:8]) - idle) / ticks_per_s, (v[5] + v[6]) / ticks_per_s, v[7] / ticks_per_s


def _machine() -> tuple[float, float, float]:
    with open("/proc/stat") as f:
        return cpu_times(f.readline(), os.sysconf("SC_CLK_TCK"))


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, user + system CPU seconds) of every process."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[int, float]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            out[int(stat.parent.name)] = (
                int(fields[1]),
                (int(fields[11]) + int(fields[12])) / ticks,
            )
    return out


@dataclass(frozen=True)
class Tick:
    """One sample; CPU figures are cumulative seconds since the sampler started."""

    at: float  # time.monotonic()
    machine_s: float
    toko_s: float
    ours_s: float  # the bench's process tree: toko-api, generator, SMTP sink, the bench
    postgres_s: float
    irq_s: float = 0.0
    steal_s: float = 0.0
    wal_bytes: int | None = None
    wal: WalIndex | None = None
    # toko-api's threads: (ran, waited for a core), cumulative seconds.
    loop_sched_s: tuple[float, float] = (0.0, 0.0)
    threads_sched_s: tuple[float, float] = (0.0, 0.0)


def thread_schedstats(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread's (ran, waited in the run queue) seconds, from schedstat."""
    out: dict[int, tuple[float, float]] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                ran, waited, _ = (int(v) for v in (task / "schedstat").read_text().split())
                out[int(task.name)] = (ran / 1e9, waited / 1e9)
    return out


class _Counter:
    """CPU seconds of a changing set of processes, summed over time."""

    def __init__(self) -> None:
        self.total = 0.0
        self.last: dict[int, float] | None = None

    def add(self, now: dict[int, float]) -> float:
        if self.last is not None:
            # A process new since the last tick started meanwhile: all of its CPU counts.
            self.total += sum(max(0.0, s - self.last.get(p, 0.0)) for p, s in now.items())
        self.last = now
        return self.total


class RunSampler:
    """The sampling thread; see the module docstring. ``ticks`` once it has stopped."""

    def __init__(
        self,
        interval: float,
        *,
        toko_pid: int,
        database: Path | None = None,
        postgres_pid: int | None = None,
    ) -> None:
        self.interval = interval
        self.toko_pid = toko_pid
        self.wal_path = Path(f"{database}-wal") if database else None
        self.shm_path = Path(f"{database}-shm") if database else None
        self.postgres_pid = postgres_pid
        self.ticks: list[Tick] = []
        self._ours = _Counter()
        self._postgres = _Counter()
        self._toko = _Counter()
        self._loop_ran, self._loop_waited = _Counter(), _Counter()
        self._threads_ran, self._threads_waited = _Counter(), _Counter()
        self._machine0 = _machine()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="run-sampler", daemon=True)

    def __enter__(self) -> RunSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _wal(self) -> tuple[int | None, WalIndex | None]:
        if self.wal_path is None or self.shm_path is None:
            return None, None
        try:
            size = os.stat(self.wal_path).st_size
        except FileNotFoundError:
            size = 0
        index = None
        with contextlib.suppress(OSError):
            fd = os.open(self.shm_path, os.O_RDONLY)
            try:
                for _ in range(3):  # a torn read is retried
                    index = parse_wal_index(os.pread(fd, 136, 0))
                    if index is not None:
                        break
            finally:
                os.close(fd)
        return size, index

    def _tick(self) -> None:
        at = time.monotonic()
        busy, irq, steal = (a - b for a, b in zip(_machine(), self._machine0, strict=True))
        table = _proc_table()
        parents = {pid: ppid for pid, (ppid, _) in table.items()}
        pg = descendants(parents, self.postgres_pid) if self.postgres_pid else set()
        ours = descendants(parents, os.getpid()) - pg
        size, index = self._wal()
        sched = thread_schedstats(self.toko_pid)
        loop = {t: v for t, v in sched.items() if t == self.toko_pid}
        others = {t: v for t, v in sched.items() if t != self.toko_pid}
        self.ticks.append(
            Tick(
                at=at,
                machine_s=busy,
                toko_s=self._toko.add({p: table[p][1] for p in (self.toko_pid,) if p in table}),
                ours_s=self._ours.add({p: table[p][1] for p in ours}),
                postgres_s=self._postgres.add({p: table[p][1] for p in pg}),
                irq_s=irq,
                steal_s=steal,
                wal_bytes=size,
                wal=index,
                loop_sched_s=(
                    self._loop_ran.add({t: v[0] for t, v in loop.items()}),
                    self._loop_waited.add({t: v[1] for t, v in loop.items()}),
                ),
                threads_sched_s=(
                    self._threads_ran.add({t: v[0] for t, v in others.items()}),
                    self._threads_waited.add({t: v[1] for t, v in others.items()}),
                ),
            )
        )

    def _run(self) -> None:
        while True:
            started = time.monotonic()
            self._tick()
            if self._stop.wait(max(0.0, self.interval - (time.monotonic() - started))):
                self._tick()  # the end of the last interval
                return


def tick_figures(ticks: Sequence[Tick], start: float, end: float) -> dict[str, Any]:
    """CPU and WAL figures over the intervals between ticks that end in [start, end).

    ``ticks[i].at`` are seconds since the schedule's t0. CPU as percent of one
    core; ``others`` is the machine minus toko-api, the bench's processes,
    PostgreSQL, interrupts and steal: other tenants' processes and kernel
    threads. WAL: file sizes and in-use sizes at the ticks, bytes checkpoints
    copied into the database, and restarts of the log (its salt changed). Both
    are lower bounds: two restarts between ticks look like one. toko-api's
    event loop thread and its other threads: percent of the time they ran
    and that they were ready to run but waited for a core.
    """
    span = 0.0
    machine = toko = ours = postgres = irq = steal = 0.0
    loop_ran = loop_waited = threads_ran = threads_waited = 0.0
    checkpointed = 0
    restarts = 0
    for prev, cur in itertools.pairwise(ticks):
        if not start <= cur.at < end:
            continue
        span += cur.at - prev.at
        machine += cur.machine_s - prev.machine_s
        toko += cur.toko_s - prev.toko_s
        ours += cur.ours_s - prev.ours_s
        postgres += cur.postgres_s - prev.postgres_s
        irq += cur.irq_s - prev.irq_s
        steal += cur.steal_s - prev.steal_s
        loop_ran += cur.loop_sched_s[0] - prev.loop_sched_s[0]
        loop_waited += cur.loop_sched_s[1] - prev.loop_sched_s[1]
        threads_ran += cur.threads_sched_s[0] - prev.threads_sched_s[0]
        threads_waited += cur.threads_sched_s[1] - prev.threads_sched_s[1]
        a, b = prev.wal, cur.wal
        if a is not None and b is not None:
            if a.salt != b.salt:
                # A restart needs every frame checkpointed first: a's rest, then b's.
                restarts += 1
                checkpointed += (a.frames - a.backfilled + b.backfilled) * b.frame_bytes
            else:
                checkpointed += max(0, b.backfilled - a.backfilled) * b.frame_bytes
    inside = [t for t in ticks if start <= t.at < end]

    def pct(seconds: float) -> float | None:
        return round(seconds / span * 100, 1) if span > 0 else None

    out: dict[str, Any] = {
        "cpu_machine_pct": pct(machine),
        "cpu_toko_pct": pct(toko),
        "cpu_bench_pct": pct(ours - toko),
        "cpu_postgres_pct": pct(postgres),
        "cpu_irq_pct": pct(irq),
        "cpu_steal_pct": pct(steal),
        "cpu_others_pct": pct(max(0.0, machine - ours - postgres - irq - steal)),
        "toko_loop_ran_pct": pct(loop_ran),
        "toko_loop_waited_pct": pct(loop_waited),
        "toko_threads_ran_pct": pct(threads_ran),
        "toko_threads_waited_pct": pct(threads_waited),
    }
    sizes = [t.wal_bytes for t in inside if t.wal_bytes is not None]
    if sizes:
        in_use = [32 + t.wal.frames * t.wal.frame_bytes for t in inside if t.wal is not None]
        out["wal_mib"] = [round(b / MIB, 2) for b in sizes]
        out["wal_max_mib"] = round(max(sizes) / MIB, 2)
        out["wal_in_use_max_mib"] = round(max(in_use) / MIB, 2) if in_use else None
        out["wal_checkpointed_mib"] = round(checkpointed / MIB, 2)
        out["wal_restarts"] = restarts
    return out
