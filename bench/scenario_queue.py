"""(e) The job queue against its peers: toko (SQLite, PostgreSQL), arq, procrastinate.

Side by side in one run, on 127.0.0.1, each system's worker in a process of
its own (``python -m bench.queue_worker <system> worker``, bench.queue_common):

- **toko**: the real queue code, ``service.workers.WorkerPool`` over
  ``SqliteStore`` or ``PostgresStore``, wired as toko-api wires it, no HTTP
  (bench.queue_toko); ``workers`` = the concurrency below throughout.
- **arq** with Debian's ``redis-server`` (bench.redis_server: free port, a
  temporary folder, persistence off: ``--save ''``, ``--appendonly no``).
- **procrastinate** (psycopg connector) on the throwaway PostgreSQL cluster of
  tests/support/postgres.py (fsync and synchronous_commit on, as for toko);
  its schema is applied by the bench into a fresh database per measurement.

Peers run twice: with their defaults and tuned for throughput; the settings
of every measurement are in the result (``systems``). Each figure is the
median of ``reps`` repetitions with min-max; the systems alternate within a
repetition, and the ratios toko ÷ peer pair figures of the same repetition.

1. **No-op drain**: ``jobs`` no-op jobs enqueued first (through each system's
   own enqueue; not measured), then one worker process drains them. Jobs/s is
   counted from the first job's start to the last job's end, as the job body
   records them (the same for every system): start-up is left out, and so is
   the acknowledgement of the last jobs.
2. **10 ms drain**: the same with jobs that ``await asyncio.sleep(0.01)``, at
   concurrency ``concurrency`` (toko workers, arq max_jobs, procrastinate
   concurrency).
3. **Enqueue→start latency** at a steady ``latency_rate`` jobs/s for
   ``latency_seconds``, open loop (job i is sent at t0 + i/rate whatever the
   previous enqueue is doing); the payload carries ``time.time()`` taken just
   before the enqueue call and the job's first line records ``time.time()``
   minus it. toko's producer runs inside the worker process and enqueues as
   toko-api's POST /produk does (``pool.enqueue_here()``: with a worker slot
   free the job is committed already leased and handed over). A second row,
   ``toko-postgres-remote`` (this measure only), enqueues from a separate
   process instead, as another toko-api instance on the same database would:
   the job reaches the worker through LISTEN/NOTIFY and a claim. The peers
   get a separate producer process (procrastinate wakes through
   LISTEN/NOTIFY, arq polls Redis), as their workers are deployed. Note:
   toko's enqueue returns after a durable commit (fsync), procrastinate's
   too; arq's returns once Redis has it in memory (persistence off), so its
   enqueue does less than toko's.
4. **Peak RSS** of the worker process: VmHWM from /proc/<pid>/status at the end
   of the no-op drain (every measurement's is in the runs).

Logging stays at WARNING in every worker (arq's CLI would log every job at
INFO; that is a deployment choice, not the queue's cost).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.procs import (
    Managed,
    base_env,
    cpu_snapshot,
    cpu_usage,
    fsync_probe,
    managed,
    remove_sqlite,
    venv_bin,
    wait_for_quiet,
)
from bench.queue_common import seed
from bench.queue_settings import settings_for
from bench.queue_worker import adapter
from bench.redis_server import RedisServer, flush_redis, redis_server
from bench.stats import Spread, fmt_spread, percentile, spread

# Measured with a producer process of its own, and a diagnostic: every other
# toko row produces in-process and is held to the targets.
REMOTE = "toko-postgres-remote"
TOKO = ("toko-sqlite", "toko-postgres", REMOTE)
PEERS = ("arq-default", "arq-tuned", "procrastinate-default", "procrastinate-tuned")
ALL_SYSTEMS = (*TOKO, *PEERS)
NAMES = {
    "toko-sqlite": "toko, SQLite",
    "toko-postgres": "toko, PostgreSQL",
    "toko-postgres-remote": "toko, PostgreSQL, enqueued by another process",
    "arq-default": "arq (Redis), defaults",
    "arq-tuned": "arq (Redis), tuned",
    "procrastinate-default": "procrastinate, defaults",
    "procrastinate-tuned": "procrastinate, tuned",
}
MEASURES = ("noop", "sleep", "latency")


def measures_of(label: str) -> tuple[str, ...]:
    # The remote row differs from toko-postgres only in where jobs are enqueued.
    return ("latency",) if label == REMOTE else MEASURES


METRICS = (
    "noop_jobs_per_s",
    "sleep_jobs_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "peak_rss_mib",
)

# How long a worker gets to connect and say it is ready.
READY_TIMEOUT_S = 60.0
# Between the worker's ready and the first latency job.
SETTLE_S = 1.0


@dataclass(frozen=True)
class Targets:
    """toko's goals from the issue."""

    noop_jobs_per_s: float = 6000.0
    latency_p50_ms: float = 1.0
    latency_p99_ms: float = 3.0


@dataclass(frozen=True)
class QueueConfig:
    jobs: int = 10_000
    reps: int = 3
    concurrency: int = 10
    latency_rate: float = 200.0
    latency_seconds: float = 10.0
    # A drain still running after this is cut: its rate is over the jobs done.
    drain_timeout_s: float = 90.0
    systems: tuple[str, ...] = ALL_SYSTEMS
    quiet_below_pct: float = 40.0
    quiet_max_wait_s: float = 15.0
    targets: Targets = field(default_factory=Targets)
    # Diagnostic: py-spy (raw collapsed stacks, --threads) on toko's workers, into this folder.
    profile_dir: Path | None = None
    profile_idle: bool = False  # include waiting threads (where latency goes, not CPU)

    def smoke(self) -> QueueConfig:
        """A quick check that everything runs (figures not meaningful)."""
        return replace(self, jobs=1000, reps=1, latency_seconds=3.0, drain_timeout_s=60.0)


def system_of(label: str) -> str:
    return label.split("-", 1)[0]


def needs(systems: tuple[str, ...]) -> tuple[bool, bool]:
    """(PostgreSQL cluster needed, Redis server needed)."""
    pg = any(s.startswith("toko-postgres") or system_of(s) == "procrastinate" for s in systems)
    redis = any(system_of(s) == "arq" for s in systems)
    return pg, redis


# -- result shaping (pure) --------------------------------------------------------------


def latency_summary(samples_ms: list[float]) -> dict[str, float] | None:
    if not samples_ms:
        return None
    return {
        "p50": percentile(samples_ms, 50),
        "p99": percentile(samples_ms, 99),
        "max": max(samples_ms),
        "n": float(len(samples_ms)),
    }


def rep_metrics(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """One repetition's figures of one system, from its three measurements."""
    noop, sleep, lat = runs.get("noop", {}), runs.get("sleep", {}), runs.get("latency", {})
    latency = lat.get("latency_ms") or {}
    rss = (noop.get("memory_kib") or {}).get("VmHWM")

    def complete_rate(run: dict[str, Any]) -> float | None:
        # A drain cut at the time limit still gives its steady rate, once a
        # tenth of the jobs ran (see ``partial``).
        enough = run.get("finished", 0) >= max(1, run.get("expect", 0) // 10)
        return run.get("jobs_per_s") if run.get("complete") or enough else None

    return {
        "noop_jobs_per_s": complete_rate(noop),
        "sleep_jobs_per_s": complete_rate(sleep),
        "latency_p50_ms": latency.get("p50") if lat.get("complete") else None,
        "latency_p99_ms": latency.get("p99") if lat.get("complete") else None,
        "peak_rss_mib": rss / 1024 if rss else None,
    }


def partial(runs: list[dict[str, dict[str, Any]]]) -> list[str]:
    """The drains (noop, sleep) some repetition cut at the time limit."""
    return [
        m
        for m in ("noop", "sleep")
        if any(r.get(m, {}).get("finished") is not None and not r[m].get("complete") for r in runs)
    ]


def figures(reps: list[dict[str, float | None]]) -> dict[str, Spread | None]:
    """Median (min-max) over repetitions of each metric; None when no repetition has it."""
    out: dict[str, Spread | None] = {}
    for metric in METRICS:
        values = [v for r in reps if (v := r.get(metric)) is not None]
        out[metric] = spread(values) if values else None
    return out


def ratios(
    toko: list[dict[str, float | None]], peer: list[dict[str, float | None]]
) -> dict[str, Spread | None]:
    """toko ÷ peer per metric, paired within each repetition, then median (min-max)."""
    out: dict[str, Spread | None] = {}
    for metric in METRICS:
        values = [
            a / b
            for t, p in zip(toko, peer, strict=False)
            if (a := t.get(metric)) is not None and (b := p.get(metric)) not in (None, 0)
        ]
        out[metric] = spread(values) if values else None
    return out


def meets(fig: dict[str, Spread | None], targets: Targets) -> dict[str, bool]:
    def median(metric: str) -> float | None:
        s = fig.get(metric)
        return s["median"] if s else None

    noop, p50, p99 = median("noop_jobs_per_s"), median("latency_p50_ms"), median("latency_p99_ms")
    return {
        "noop_jobs_per_s": noop is not None and noop >= targets.noop_jobs_per_s,
        "latency_p50_ms": p50 is not None and p50 <= targets.latency_p50_ms,
        "latency_p99_ms": p99 is not None and p99 <= targets.latency_p99_ms,
    }


def shape(
    cfg: QueueConfig,
    runs: dict[str, list[dict[str, dict[str, Any]]]],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON result from the raw runs: runs[label][rep][measure] = worker's figures."""
    per_rep = {label: [rep_metrics(r) for r in reps] for label, reps in runs.items()}
    figs = {label: figures(reps) for label, reps in per_rep.items()}
    toko = [label for label in runs if label in TOKO]
    peers = [label for label in runs if label not in TOKO]
    met_by = {label: meets(figs[label], cfg.targets) for label in toko if label != REMOTE}
    return {
        "config": {
            "jobs": cfg.jobs,
            "reps": cfg.reps,
            "concurrency": cfg.concurrency,
            "latency_rate": cfg.latency_rate,
            "latency_seconds": cfg.latency_seconds,
            "drain_timeout_s": cfg.drain_timeout_s,
            "systems": list(runs),
            "drain_rate": "jobs / (last job end - first job start), as the job body records them",
            "redis": "redis-server 127.0.0.1, --save '' --appendonly no (no persistence)",
            "postgres": "throwaway cluster 127.0.0.1, fsync=on, synchronous_commit=on",
        },
        "systems": {
            label: {
                "name": NAMES.get(label, label),
                "settings": {
                    m: settings_for(label, m, cfg.concurrency) for m in measures_of(label)
                },
            }
            for label in runs
        },
        "figures": figs,
        "partial": {label: p for label, reps in runs.items() if (p := partial(reps))},
        "ratios": {t: {p: ratios(per_rep[t], per_rep[p]) for p in peers} for t in toko},
        "targets": asdict(cfg.targets),
        "met_by": met_by,
        "met": bool(met_by) and all(all(m.values()) for m in met_by.values()),
        "runs": runs,
        **(extra or {}),
    }


# -- running ------------------------------------------------------------------------------


class _Backends:
    """The servers the peers and toko-postgres need, and a fresh queue per measurement."""

    def __init__(self, workdir: Path, cluster: Any, redis: RedisServer | None) -> None:
        self.workdir = workdir
        self.cluster = cluster
        self.redis = redis
        self.cleanup: list[Callable[[], None]] = []

    def fresh(self, label: str, name: str) -> dict[str, Any]:
        system = system_of(label)
        if label == "toko-sqlite":
            path = self.workdir / f"{name}.db"
            remove_sqlite(path)
            self.cleanup.append(lambda: remove_sqlite(path))
            return {"database": str(path)}
        if system == "arq":
            assert self.redis is not None
            flush_redis(self.redis.port)
            return self.redis.target
        assert self.cluster is not None
        url = self.cluster.create_database("bq")
        self.cleanup.append(lambda: asyncio.run(self.cluster.async_drop_database(url)))
        password_file = str(self.cluster.password_file)
        if system == "toko":
            return {"database": url, "password_file": password_file}
        target = {"url": url, "password_file": password_file}
        from bench.queue_procrastinate import apply_schema  # the bench extra only

        asyncio.run(apply_schema(target))
        return target

    def done_with(self) -> None:
        while self.cleanup:
            with contextlib.suppress(Exception):
                self.cleanup.pop()()


def _cmd(system: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "bench.queue_worker", system, *args]


def _wait_file(path: Path, proc: Managed, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        proc.check_alive()
        time.sleep(0.02)
    return path.exists()


def _read_result(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    data["latency_ms"] = latency_summary(data.pop("latencies_ms", []))
    return data


def _measure(
    cfg: QueueConfig, backends: _Backends, label: str, measure: str, rep: int
) -> dict[str, Any]:
    system = system_of(label)
    name = f"{label}-{measure}-{rep}"
    workdir = backends.workdir
    out, ready = workdir / f"{name}.json", workdir / f"{name}.ready"
    for path in (out, ready):
        path.unlink(missing_ok=True)
    target = backends.fresh(label, name)
    settings = settings_for(label, measure, cfg.concurrency)
    kind = "sleep" if measure == "sleep" else "noop"
    latency = measure == "latency"
    in_process = latency and label in TOKO and label != REMOTE
    expect = int(cfg.latency_rate * cfg.latency_seconds) if latency else cfg.jobs
    timeout = cfg.latency_seconds + 60.0 if latency else cfg.drain_timeout_s
    seeded_s = None
    if not latency:
        seeded_s = asyncio.run(seed(adapter(system), target, kind, cfg.jobs))
    quiet = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
    args = [
        "worker",
        *("--target", json.dumps(target), "--settings", json.dumps(settings)),
        *("--kind", kind, "--expect", str(expect), "--timeout", str(timeout)),
        *("--out", str(out), "--ready", str(ready)),
    ]
    if in_process:
        args += ["--produce-rate", str(cfg.latency_rate)]
        args += ["--produce-seconds", str(cfg.latency_seconds), "--produce-after", str(SETTLE_S)]
    produced: dict[str, Any] | None = None
    log = workdir / f"{name}.log"
    with contextlib.ExitStack() as stack:
        w = stack.enter_context(managed(label, _cmd(system, *args), log_path=log, env=base_env()))
        cpu0 = cpu_snapshot(w.pid)
        if not _wait_file(ready, w, READY_TIMEOUT_S):
            raise RuntimeError(f"{label} worker not ready in {READY_TIMEOUT_S}s: {w.tail()}")
        if cfg.profile_dir is not None and system == "toko":
            stack.enter_context(_profiler(cfg, w.pid, name))
        if latency and not in_process:
            produced = _produce(cfg, system, target, workdir, name)
        finished = _wait_file(out, w, timeout)
        cpu = cpu_usage(cpu0, cpu_snapshot(w.pid))
        w.stop()  # on a timeout the worker writes what it has on SIGTERM
    if not out.exists():
        raise RuntimeError(f"{label} worker wrote no result: {w.tail()}")
    result = _read_result(out)
    if produced is not None:
        result["produced"] = produced
    result.update(
        {
            "timed_out": not finished,
            "seed_s": round(seeded_s, 2) if seeded_s is not None else None,
            "before": quiet,
            "cpu": {"worker_pct": cpu["server_pct"], "machine_pct": cpu["machine_pct"]},
        }
    )
    return result


@contextlib.contextmanager
def _profiler(cfg: QueueConfig, pid: int, name: str) -> Iterator[None]:
    """py-spy attached to ``pid``; it writes its file when the process exits."""
    assert cfg.profile_dir is not None
    cfg.profile_dir.mkdir(parents=True, exist_ok=True)
    out = cfg.profile_dir / f"{name}.txt"
    cmd = [str(venv_bin("py-spy")), "record", "--pid", str(pid), "--format", "raw"]
    cmd += ["--threads", "--nonblocking", "--rate", "250", "--output", str(out)]
    if cfg.profile_idle:
        cmd.append("--idle")
    with managed(f"py-spy {name}", cmd, log_path=cfg.profile_dir / f"{name}.py-spy.log") as p:
        yield
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(15)  # the worker has exited by now: py-spy writes and ends


def _produce(
    cfg: QueueConfig, system: str, target: dict[str, Any], workdir: Path, name: str
) -> dict[str, Any]:
    time.sleep(SETTLE_S)
    out = workdir / f"{name}.produced.json"
    out.unlink(missing_ok=True)
    args = [
        "produce",
        *("--target", json.dumps(target), "--kind", "noop"),
        *("--rate", str(cfg.latency_rate), "--seconds", str(cfg.latency_seconds)),
        *("--timeout", str(cfg.latency_seconds + 30.0), "--out", str(out)),
    ]
    log = workdir / f"{name}.producer.log"
    with managed(f"{name}-producer", _cmd(system, *args), log_path=log, env=base_env()) as p:
        p.proc.wait(cfg.latency_seconds + 45.0)
    if not out.exists():
        raise RuntimeError(f"{name} producer wrote no result: {p.tail()}")
    data: dict[str, Any] = json.loads(out.read_text())
    return data


@contextlib.contextmanager
def _servers(cfg: QueueConfig, workdir: Path) -> Iterator[_Backends]:
    from tests.support.postgres import acquire_cluster, release_cluster

    pg, redis = needs(cfg.systems)
    with contextlib.ExitStack() as stack:
        cluster = None
        if pg:
            cluster = acquire_cluster()
            stack.callback(release_cluster)
        server = stack.enter_context(redis_server(workdir / "redis.log")) if redis else None
        yield _Backends(workdir, cluster, server)


def _print(label: str, measure: str, r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"  {label:22s} {measure:7s} error: {r['error'][:200]}", flush=True)
        return
    lat = r.get("latency_ms") or {}
    rate = r.get("jobs_per_s")
    figure = (
        f"p50 {lat.get('p50', float('nan')):.2f} ms  p99 {lat.get('p99', float('nan')):.2f} ms"
        if measure == "latency"
        else f"{rate or 0:8.0f} jobs/s"
    )
    hwm = (r.get("memory_kib") or {}).get("VmHWM", 0) / 1024
    print(
        f"  {label:22s} {measure:7s} {figure}  ({r['finished']}/{r['expect']} done, "
        f"peak RSS {hwm:.1f} MiB, worker CPU {r['cpu']['worker_pct']:.0f} %)",
        flush=True,
    )


def run(cfg: QueueConfig, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {label: [] for label in cfg.systems}
    with _servers(cfg, workdir) as backends:
        probe = fsync_probe(workdir)
        for rep in range(cfg.reps):
            print(f"  repetition {rep + 1}/{cfg.reps}", flush=True)
            for label in cfg.systems:
                runs[label].append({})
            for measure in MEASURES:
                for label in cfg.systems:
                    if measure not in measures_of(label):
                        continue
                    try:
                        r = _measure(cfg, backends, label, measure, rep)
                    except Exception as exc:  # one system's failure must not end the run
                        r = {"error": f"{type(exc).__name__}: {exc}"}
                    finally:
                        backends.done_with()
                    runs[label][rep][measure] = r
                    _print(label, measure, r)
    return shape(cfg, runs, {"fsync_probe_ms": probe, "toko_tree": toko_tree()})


def toko_tree() -> dict[str, Any]:
    """Which toko the workers ran: this tree's commit, and whether service/ had local edits."""
    from bench.procs import REPO

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
        )
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "service_modified": bool(git("status", "--porcelain", "--", "service")),
    }


# -- the table ---------------------------------------------------------------------------


def _fmt(s: Spread | None, fmt: str, unit: str = "") -> str:
    return fmt_spread(s, fmt, unit) if s else "n/a"


def _ratio(s: Spread | None) -> str:
    return _fmt(s, "{:.3g}")  # 3 significant digits: latency ratios get small


def report_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows for bench.report: (scenario, measure, value, target)."""
    c = result["config"]
    t = result["targets"]
    measure = (
        f"no-op jobs/s · 10 ms jobs/s (conc. {c['concurrency']}) · enqueue→start p50 · p99"
        f" at {c['latency_rate']:g}/s · peak RSS ({c['jobs']} jobs, median of {c['reps']})"
    )
    out: list[tuple[str, str, str, str]] = []
    cut = result.get("partial", {})
    if cut:
        measure += f"; † drain cut at {c.get('drain_timeout_s', '?')} s, rate over the jobs done"
    for label, f in result["figures"].items():
        mark = {m: " †" if m in cut.get(label, []) else "" for m in ("noop", "sleep")}
        target = ""
        if label in result.get("met_by", {}):
            m = result["met_by"][label]
            ok = "✅ met" if all(m.values()) else "❌ missed"
            target = (
                f"≥ {t['noop_jobs_per_s']:g}/s, p50 ≤ {t['latency_p50_ms']:g} ms,"
                f" p99 ≤ {t['latency_p99_ms']:g} ms {ok}"
            )
        out.append(
            (
                f"(e) queue, {result['systems'][label]['name']}",
                measure,
                f"{_fmt(f['noop_jobs_per_s'], '{:.0f}')}{mark['noop']}"
                f" · {_fmt(f['sleep_jobs_per_s'], '{:.0f}')}{mark['sleep']}"
                f" · {_fmt(f['latency_p50_ms'], '{:.2f}', ' ms')}"
                f" · {_fmt(f['latency_p99_ms'], '{:.2f}', ' ms')}"
                f" · {_fmt(f['peak_rss_mib'], '{:.1f}', ' MiB')}",
                target,
            )
        )
    for toko, peers in result["ratios"].items():
        for peer, r in peers.items():
            out.append(
                (
                    f"(e) ratio {result['systems'][toko]['name']} ÷ "
                    f"{result['systems'][peer]['name']}",
                    "no-op jobs/s · 10 ms jobs/s · p50 · p99 · peak RSS"
                    " (>1 faster; <1 quicker, smaller)",
                    " · ".join(_ratio(r[m]) for m in METRICS),
                    "",
                )
            )
    return out


def markdown(result: dict[str, Any]) -> list[str]:
    """README-ready lines: one row per system, then the ratios toko ÷ peer."""
    c, t = result["config"], result["targets"]
    cut = result.get("partial", {})
    out = [
        f"**(e) The queue against its peers**: {c['jobs']} jobs per drain, 10 ms jobs at"
        f" concurrency {c['concurrency']}, latency at a steady {c['latency_rate']:g} jobs/s"
        f" for {c['latency_seconds']:g} s; median of {c['reps']} (min-max). Targets for toko:"
        f" ≥ {t['noop_jobs_per_s']:g} no-op jobs/s, p50 ≤ {t['latency_p50_ms']:g} ms,"
        f" p99 ≤ {t['latency_p99_ms']:g} ms.",
        "",
        "| System | no-op jobs/s | 10 ms jobs/s | enqueue→start p50 | p99 | worker peak RSS |"
        " toko targets |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, f in result["figures"].items():
        mark = {m: " †" if m in cut.get(label, []) else "" for m in ("noop", "sleep")}
        met = result.get("met_by", {}).get(label)
        verdict = ""
        if met is not None:
            labels = {"noop_jobs_per_s": "no-op rate", "latency_p50_ms": "p50"}
            missed = [labels.get(n, n.split("_")[1]) for n, ok in met.items() if not ok]
            verdict = "✅ all met" if not missed else "❌ missed: " + ", ".join(missed)
        elif label == REMOTE:
            verdict = "diagnostic ‡"
        out.append(
            f"| {result['systems'][label]['name']}"
            f" | {_fmt(f['noop_jobs_per_s'], '{:.0f}')}{mark['noop']}"
            f" | {_fmt(f['sleep_jobs_per_s'], '{:.0f}')}{mark['sleep']}"
            f" | {_fmt(f['latency_p50_ms'], '{:.2f}', ' ms')}"
            f" | {_fmt(f['latency_p99_ms'], '{:.2f}', ' ms')}"
            f" | {_fmt(f['peak_rss_mib'], '{:.1f}', ' MiB')} | {verdict} |"
        )
    if REMOTE in result["figures"]:
        out += [
            "",
            "‡ A job another toko-api instance enqueued on the shared database: it reaches"
            " this instance's workers through LISTEN/NOTIFY and a claim, one more durable"
            " round trip than a job enqueued here (the row above, whose drains it shares).",
        ]
    if cut:
        out += [
            "",
            f"† the drain was cut at {c.get('drain_timeout_s', '?')} s; the rate is over the"
            " jobs done by then.",
        ]
    out += [
        "",
        "Ratios toko ÷ peer, paired within each repetition (above 1: toko drains faster;"
        " below 1: toko starts jobs sooner or uses less memory):",
        "",
        "| toko ÷ peer | no-op jobs/s | 10 ms jobs/s | p50 | p99 | peak RSS |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for toko, peers in result["ratios"].items():
        for peer, r in peers.items():
            cells = " | ".join(_ratio(r[m]) for m in METRICS)
            names = f"{result['systems'][toko]['name']} ÷ {result['systems'][peer]['name']}"
            out.append(f"| {names} | {cells} |")
    return [*out, ""]


def _main(argv: list[str]) -> int:
    """Development entry: ``python -m bench.scenario_queue [--smoke] [--profile=DIR] [system ...]``.

    ``--profile=DIR`` attaches py-spy to toko's workers (``--idle`` too: waits
    included); ``--reps=N``, ``--jobs=N``, ``--quiet-max-wait=S`` override the defaults.
    """
    import tempfile

    flags = dict(a[2:].partition("=")[::2] for a in argv if a.startswith("--"))
    systems = tuple(a for a in argv if not a.startswith("--")) or ALL_SYSTEMS
    cfg = QueueConfig(systems=systems)
    if "smoke" in flags:
        cfg = cfg.smoke()
    if flags.get("reps"):
        cfg = replace(cfg, reps=int(flags["reps"]))
    if flags.get("jobs"):
        cfg = replace(cfg, jobs=int(flags["jobs"]))
    if flags.get("quiet-max-wait"):
        cfg = replace(cfg, quiet_max_wait_s=float(flags["quiet-max-wait"]))
    if flags.get("profile"):
        cfg = replace(cfg, profile_dir=Path(flags["profile"]), profile_idle="idle" in flags)
    workdir = Path(tempfile.mkdtemp(prefix="toko-bench-queue-"))
    result = run(cfg, workdir)
    (workdir / "result.json").write_text(json.dumps(result, indent=2))
    for row in report_rows(result):
        print(" | ".join(row))
    print(f"results in {workdir / 'result.json'}")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
