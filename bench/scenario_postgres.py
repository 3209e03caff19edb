"""(d) PostgreSQL: durable POST throughput with one and two toko-api instances,
and jobs/s drained, side by side with SQLite in the same run.

The server is the tests' throwaway cluster (``tests.support.postgres``: the
Debian server binaries, 127.0.0.1, fsync and synchronous_commit on), on the
same machine as everything else, so the figures compare backends, not
network set-ups.

- POST: wrk at ``connections`` connections in all, split over the instances
  (two wrk processes for two instances, run at the same time), after a
  discarded warm-up; every request acknowledged must be a row afterwards.
- Drain: ``drain_jobs`` products and their email jobs are committed first
  (through the store, no API running), then the instances start with
  ``drain_workers`` workers each against an instant SMTP server; jobs/s is
  measured between 10 % and 90 % done, so start-up does not count.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import Managed, cpu_snapshot, cpu_usage, wait_for_quiet
from bench.sink import smtp_sink
from bench.toko import Target, TokoCommand, get_json, running, toko_target
from bench.wrk import POST_PRODUK_LUA, WrkResult, run_wrk
from service.models import NewJob, Product
from service.store.postgres import PostgresStore
from service.store.roles import Store
from service.store.sqlite import SqliteStore
from service.tasks import product_email_job
from tests.support.postgres import PostgresCluster, acquire_cluster, release_cluster

# (label, backend, instances), measured in this order.
SETUPS = (("sqlite-1", "sqlite", 1), ("postgres-1", "postgres", 1), ("postgres-2", "postgres", 2))


@dataclass(frozen=True)
class PostgresConfig:
    toko: TokoCommand
    duration_s: float = 10.0
    warmup_s: float = 2.0
    connections: int = 16
    threads: int = 1
    drain_jobs: int = 5000
    drain_workers: int = 16
    drain_timeout_s: float = 300.0
    quiet_below_pct: float = 40.0
    quiet_max_wait_s: float = 15.0


def drain_rate(samples: list[tuple[float, int]], total: int) -> float | None:
    """Jobs/s between 10 % and 90 % of ``total`` done, from (time, done) samples."""
    low, high = 0.1 * total, 0.9 * total
    start = next(((t, d) for t, d in samples if d >= low), None)
    end = next(((t, d) for t, d in samples if d >= high), None)
    if start is None or end is None or end[0] <= start[0]:
        return None
    return (end[1] - start[1]) / (end[0] - start[0])


class _Databases:
    """A fresh database per measurement: a SQLite file or a PostgreSQL database."""

    def __init__(self, cluster: PostgresCluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.made: list[str] = []

    def new(self, backend: str, label: str) -> str:
        if backend == "sqlite":
            return str(self.workdir / f"{label}.db")
        url = self.cluster.create_database("bench")
        self.made.append(url)
        return url

    def env(self, backend: str) -> dict[str, str]:
        if backend == "sqlite":
            return {}
        return {"TOKO_DATABASE_PASSWORD_FILE": str(self.cluster.password_file)}

    def store(self, database: str) -> Store:
        if database.startswith("postgresql://"):
            return PostgresStore(database, password=self.cluster.password)
        return SqliteStore(database)

    def rows(self, database: str) -> int:
        async def count() -> int:
            store = self.store(database)
            await store.open()
            try:
                total, _ = await store.product_counts(0.0, float("inf"))
                return total
            finally:
                await store.close()

        return asyncio.run(count())


@contextlib.contextmanager
def _instances(targets: list[Target], workdir: Path, label: str) -> Iterator[list[Managed]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(running(t, workdir / f"{label}-{i}.log"))
            for i, t in enumerate(targets)
        ]


def _wrk_all(
    targets: list[Target], cfg: PostgresConfig, script: Path, duration: float, token: str, log: Path
) -> list[WrkResult]:
    per = max(1, cfg.connections // len(targets))
    with ThreadPoolExecutor(len(targets)) as pool:
        futures = [
            pool.submit(
                run_wrk,
                t.base_url + "/produk",
                script=script,
                duration_s=duration,
                connections=per,
                threads=cfg.threads,
                token=f"{token}-{i}",
                log=log,
            )
            for i, t in enumerate(targets)
        ]
        return [f.result() for f in futures]


def _post(
    cfg: PostgresConfig, dbs: _Databases, workdir: Path, label: str, backend: str, count: int
) -> dict[str, Any]:
    script = workdir / "post_produk.lua"
    script.write_text(POST_PRODUK_LUA)
    database = dbs.new(backend, f"post-{label}")
    targets = [
        toko_target(cfg.toko, Path(database), extra_env={**dbs.env(backend)}) for _ in range(count)
    ]
    for t in targets:
        t.env["TOKO_DATABASE"] = database  # a URL is not a Path
    quiet = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
    log = workdir / "wrk.log"
    with _instances(targets, workdir, f"post-{label}") as procs:
        warm = _wrk_all(targets, cfg, script, cfg.warmup_s, f"{label}-warm", log)
        cpu0 = [cpu_snapshot(p.pid) for p in procs]
        results = _wrk_all(targets, cfg, script, cfg.duration_s, label, log)
        cpu = [cpu_usage(c, cpu_snapshot(p.pid)) for c, p in zip(cpu0, procs, strict=True)]
        for p in procs:
            p.stop()
    acknowledged = sum(r.requests - r.error_count for r in warm + results)
    rows = dbs.rows(database)
    return {
        "instances": count,
        "rps": sum(r.rps for r in results),
        "p50_ms": max(r.latency_ms["p50"] for r in results),
        "p99_ms": max(r.latency_ms["p99"] for r in results),
        "errors": sum(r.error_count for r in results),
        "acknowledged": acknowledged,
        "rows_in_db": rows,
        "durable": rows >= acknowledged,
        "server_cpu_pct": [round(c["server_pct"], 1) for c in cpu],
        "before": quiet,
        "wrk": [r.to_json() for r in results],
    }


def _seed(dbs: _Databases, database: str, jobs: int) -> None:
    def job(product: Product) -> NewJob:
        return product_email_job(product, 5)

    async def seed() -> None:
        store = dbs.store(database)
        await store.open()
        try:
            for start in range(0, jobs, 500):
                await asyncio.gather(
                    *(
                        store.create_product(f"drain-{i}", i, job)
                        for i in range(start, min(jobs, start + 500))
                    )
                )
        finally:
            await store.close()

    asyncio.run(seed())


def _drain(
    cfg: PostgresConfig, dbs: _Databases, workdir: Path, label: str, backend: str, count: int
) -> dict[str, Any]:
    database = dbs.new(backend, f"drain-{label}")
    _seed(dbs, database, cfg.drain_jobs)
    quiet = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
    samples: list[tuple[float, int]] = []
    with smtp_sink(workdir, f"drain-{label}-smtp", 0.0, workdir / f"drain-{label}.tsv") as sink:
        targets = [
            toko_target(
                cfg.toko,
                Path(database),
                workers=cfg.drain_workers,
                smtp_url=sink.url,
                log_level="warning",
                extra_env=dbs.env(backend),
            )
            for _ in range(count)
        ]
        for t in targets:
            t.env["TOKO_DATABASE"] = database
        t0 = time.monotonic()
        with _instances(targets, workdir, f"drain-{label}") as procs:
            while True:
                _, body = get_json(targets[0].base_url + "/healthz")
                done = int(body["queue"]["done"]) if isinstance(body, dict) else 0
                samples.append((time.monotonic(), done))
                if done >= cfg.drain_jobs or time.monotonic() - t0 > cfg.drain_timeout_s:
                    break
                time.sleep(0.05)
            for p in procs:
                p.stop()
    rate = drain_rate(samples, cfg.drain_jobs)
    return {
        "instances": count,
        "workers_each": cfg.drain_workers,
        "jobs": cfg.drain_jobs,
        "done": samples[-1][1],
        "seconds_from_start": round(samples[-1][0] - t0, 2),
        "jobs_per_s": rate,
        "before": quiet,
    }


def run(cfg: PostgresConfig, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = acquire_cluster()
    dbs = _Databases(cluster, workdir)
    try:
        post: dict[str, Any] = {}
        drain: dict[str, Any] = {}
        for label, backend, count in SETUPS:
            post[label] = p = _post(cfg, dbs, workdir, label, backend, count)
            print(
                f"  POST {label:10s} {p['rps']:8.0f} req/s  p50 {p['p50_ms']:.2f} ms  "
                f"p99 {p['p99_ms']:.2f} ms  errors {p['errors']}  durable {p['durable']}",
                flush=True,
            )
        for label, backend, count in SETUPS:
            drain[label] = d = _drain(cfg, dbs, workdir, label, backend, count)
            print(
                f"  drain {label:10s} {d['jobs_per_s'] or 0:8.0f} jobs/s  "
                f"({d['done']}/{d['jobs']} in {d['seconds_from_start']} s)",
                flush=True,
            )
    finally:
        release_cluster()
    ok = all(p["durable"] and p["errors"] == 0 for p in post.values()) and all(
        d["done"] == d["jobs"] for d in drain.values()
    )
    return {
        "config": {
            "duration_s": cfg.duration_s,
            "warmup_s": cfg.warmup_s,
            "connections": cfg.connections,
            "drain_jobs": cfg.drain_jobs,
            "drain_workers": cfg.drain_workers,
            "server": "throwaway PostgreSQL on 127.0.0.1 (fsync on), same machine",
        },
        "post": post,
        "drain": drain,
        "met": ok,
    }


def report_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows for bench.report: (scenario, measure, value, target)."""
    c = result["config"]
    out: list[tuple[str, str, str, str]] = []
    for label, p in result["post"].items():
        out.append(
            (
                f"(d) POST /produk, {label}",
                f"req/s · p50 · p99 ({c['connections']} conns in all, {c['duration_s']:g} s)",
                f"{p['rps']:.0f} · {p['p50_ms']:.2f} ms · {p['p99_ms']:.2f} ms"
                f" · errors {p['errors']} · durable {p['durable']}",
                "",
            )
        )
    for label, d in result["drain"].items():
        rate = d["jobs_per_s"]
        out.append(
            (
                f"(d) drain, {label}",
                f"jobs/s, 10-90 % of {d['jobs']} ({d['workers_each']} workers each)",
                (f"{rate:.0f}" if rate else "n/a") + f" ({d['done']}/{d['jobs']} done)",
                "all done ✅" if d["done"] == d["jobs"] else "all done ❌",
            )
        )
    return out
