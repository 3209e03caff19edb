"""(j) Email: how fast toko-api's own workers drain a backlog, on one core.

A backlog of ``jobs`` product emails is made the way users make it: POSTs to
a toko-api whose SMTP server holds every email for an hour (bench.smtp_sink),
one worker, so the jobs wait in the database. Then a fresh toko-api on the
same database, ``workers`` workers, pinned to one core (``taskset``), drains
them into Postfix's ``smtp-sink`` (bench.postfix) pinned to the other core, so
neither takes the other's CPU. Emails/s runs from that toko-api's READY to the
sink's count reaching ``jobs``; CPU per email is toko-api's process CPU over
the same span. Each email goes out as toko always sends it (headers,
Message-ID), and every job must end ``done``.

The sink's own ceiling (scenario (h), smtp-source into smtp-sink) says how
much of the figure is toko's: a drain near the ceiling would be the sink's.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.postfix import postfix_sink
from bench.procs import cpu_snapshot, cpu_usage, remove_sqlite, wait_for_quiet
from bench.sink import smtp_sink
from bench.stats import fmt_spread, spread
from bench.toko import Target, TokoCommand, running, toko_target


@dataclass(frozen=True)
class EmailConfig:
    toko: TokoCommand
    jobs: int = 20_000
    workers: int = 16
    reps: int = 3
    target_per_s: float = 2000.0
    drain_timeout_s: float = 120.0
    fill_concurrency: int = 32
    # The core toko-api may use, and the sink's; the machine has two.
    toko_core: int = 1
    sink_core: int = 0
    quiet_below_pct: float = 40.0
    quiet_max_wait_s: float = 30.0

    @staticmethod
    def smoke(toko: TokoCommand, **overrides: Any) -> EmailConfig:
        base: dict[str, Any] = {"jobs": 1000, "reps": 1, "quiet_max_wait_s": 5.0}
        return EmailConfig(toko=toko, **{**base, **overrides})


def _pinned(target: Target, core: int) -> Target:
    # taskset sets the affinity and execs: every thread toko-api starts keeps it.
    return replace(target, cmd=["taskset", "-c", str(core), *target.cmd])


async def _post_products(url: str, count: int, concurrency: int) -> int:
    created = 0
    queue = iter(range(count))

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal created
        for i in queue:
            body = {"nama": f"Kopi Arabika {i}", "harga": 25_000 + i}
            async with session.post(url, json=body) as resp:
                if resp.status == 201:
                    created += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return created


def _job_states(db: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return dict(conn.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())


def _fill(cfg: EmailConfig, db: Path, workdir: Path) -> int:
    """The backlog: ``cfg.jobs`` products, their emails held back by a slow server."""
    with smtp_sink(workdir, "hold-smtp", 3600.0, workdir / "hold-smtp.tsv") as hold:
        target = toko_target(cfg.toko, db, workers=1, smtp_url=hold.url)
        with running(target, workdir / "fill-toko-api.log") as api:
            created = asyncio.run(
                _post_products(target.base_url + "/produk", cfg.jobs, cfg.fill_concurrency)
            )
            api.stop(timeout=60)
    return created


def _drain(cfg: EmailConfig, db: Path, workdir: Path, label: str) -> dict[str, Any]:
    quiet = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
    with postfix_sink(workdir, f"{label}-smtp-sink") as sink:
        os.sched_setaffinity(sink.proc.pid, {cfg.sink_core})
        before = sink.messages()
        target = _pinned(
            toko_target(cfg.toko, db, workers=cfg.workers, smtp_url=sink.url), cfg.toko_core
        )
        with running(target, workdir / f"{label}-toko-api.log") as api:
            t0 = time.monotonic()
            cpu0 = cpu_snapshot(api.pid)
            got = sink.wait_messages(before + cfg.jobs, cfg.drain_timeout_s) - before
            seconds = time.monotonic() - t0
            cpu1 = cpu_snapshot(api.pid)
            api.stop(timeout=60)
    cpu = cpu_usage(cpu0, cpu1)
    states = _job_states(db)
    toko_cpu_s = (cpu1.process_s - cpu0.process_s) if got else 0.0
    return {
        "label": label,
        "before": quiet,
        "delivered": got,
        "seconds": round(seconds, 3),
        "emails_per_s": round(got / seconds, 1) if seconds > 0 else 0.0,
        "cpu_ms_per_email": round(toko_cpu_s * 1000 / got, 3) if got else None,
        "cpu": cpu,
        "job_states": states,
        "all_done": states.get("done", 0) == cfg.jobs and len(states) == 1,
    }


def run(cfg: EmailConfig, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    drains = []
    for rep in range(cfg.reps):
        label = f"drain-{rep + 1}"
        db = workdir / f"{label}.db"
        remove_sqlite(db)
        created = _fill(cfg, db, workdir)
        if created != cfg.jobs:
            raise RuntimeError(f"the backlog has {created} products, not {cfg.jobs}")
        result = _drain(cfg, db, workdir, label)
        drains.append(result)
        print(
            f"  {label}: {result['delivered']}/{cfg.jobs} emails in {result['seconds']:.2f} s: "
            f"{result['emails_per_s']:.0f}/s on one core, {result['cpu_ms_per_email']} ms CPU "
            f"each (toko-api {result['cpu']['server_pct']:.0f} % of a core, others "
            f"{result['cpu']['others_pct']:.0f} %); jobs {result['job_states']}",
            flush=True,
        )
    summary = summarise(drains, cfg.target_per_s)
    return {
        "config": {
            "jobs": cfg.jobs,
            "workers": cfg.workers,
            "reps": cfg.reps,
            "toko_core": cfg.toko_core,
            "sink_core": cfg.sink_core,
            "target_per_s": cfg.target_per_s,
            "sink": "Postfix smtp-sink (bench.postfix), its own core",
        },
        "drains": drains,
        "summary": summary,
        "met": summary["met"],
    }


def summarise(drains: list[dict[str, Any]], target_per_s: float) -> dict[str, Any]:
    """Median (min-max) of the drains; the target counts the slowest."""
    rates = [d["emails_per_s"] for d in drains]
    all_done = all(d["all_done"] for d in drains)
    return {
        "emails_per_s": spread(rates),
        "cpu_ms_per_email": spread([d["cpu_ms_per_email"] or 0.0 for d in drains]),
        "all_done": all_done,
        "met": all_done and min(rates) >= target_per_s,
    }


def report_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    c, s = result["config"], result["summary"]
    rate, cpu = s["emails_per_s"], s["cpu_ms_per_email"]
    return [
        (
            "(j) email drain",
            f"{c['jobs']} product emails, {c['workers']} workers, toko-api on one core, "
            f"into smtp-sink: emails/s · ms CPU per email, median of {c['reps']} (min-max)",
            f"{fmt_spread(rate)} · {fmt_spread(cpu, '{:.3f}')}; every job done: "
            f"{'yes' if s['all_done'] else 'NO'}",
            f"≥ {c['target_per_s']:g}/s {'✅ met' if result['met'] else '❌ missed'}",
        )
    ]
