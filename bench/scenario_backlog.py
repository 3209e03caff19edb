"""(b) The tutorial's scenario: slow email, steady POST load, and no job lost.

A real SMTP server (``bench.smtp_sink``) takes ``email_delay`` seconds per
message; toko-api runs ``workers`` workers against it. ``bench.loadgen``
offers a constant ``rate`` of POST /produk for ``duration`` seconds, open
loop. The backlog (rate x duration emails at workers/delay per second) is far
too long to drain in a bench, so "no job lost" is proven in steps:

1. every POST got a 201 with a product id, and those ids are exactly the
   products in the database;
2. the jobs table holds exactly one email job per product, each pending,
   running or done (none failed, none missing);
3. the SMTP server received distinct Message-IDs at about workers/delay per
   second while the backlog stood, and no Message-ID twice;
4. optionally, toko-api is stopped (SIGTERM, must exit 0), the SMTP server
   restarted without delay, toko-api started again on the same database, and
   the backlog drains completely: distinct Message-IDs == products.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loadgen import open_loop
from bench.procs import FsyncMonitor, cpu_snapshot, cpu_usage, wait_for_quiet
from bench.sink import read_record, smtp_sink
from bench.stats import percentile
from bench.toko import TokoCommand, running, toko_target


@dataclass(frozen=True)
class BacklogConfig:
    toko: TokoCommand
    rate: float = 500.0
    duration_s: float = 30.0
    email_delay_s: float = 2.0
    workers: int = 3
    settle_s: float = 5.0
    p99_target_ms: float = 20.0
    full_drain: bool = True
    drain_timeout_s: float = 420.0
    drain_workers: int = 16
    max_connections: int = 256
    quiet_below_pct: float = 40.0
    quiet_max_wait_s: float = 30.0


def payload_product_id(payload: str | None) -> int | None:
    try:
        data = json.loads(payload or "")
    except ValueError:
        return None
    if isinstance(data, dict):
        for key in ("product_id", "produk_id", "id"):
            value = data.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def inspect_queue(db: Path) -> dict[str, Any]:
    """Products, email jobs and their states, read-only (safe while toko-api runs)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        product_ids = {int(r[0]) for r in conn.execute("SELECT id FROM products")}
        jobs = conn.execute("SELECT kind, state, payload FROM jobs").fetchall()
    per_product: Counter[int] = Counter()
    states: Counter[str] = Counter()
    unlinked = 0
    for kind, state, payload in jobs:
        states[str(state)] += 1
        if kind != "product_email":
            continue
        pid = payload_product_id(payload)
        if pid is None:
            unlinked += 1
        else:
            per_product[pid] += 1
    without_one = sum(1 for p in product_ids if per_product.get(p, 0) != 1)
    orphans = sum(1 for p in per_product if p not in product_ids)
    return {
        "products": len(product_ids),
        "product_ids": product_ids,
        "jobs": len(jobs),
        "states": dict(sorted(states.items())),
        "products_without_one_job": without_one,
        "jobs_without_product": orphans,
        "jobs_without_product_id_in_payload": unlinked,
    }


def _add_fsync(summary: dict[str, Any], samples: list[tuple[float, float]], t0: float) -> None:
    """Put the disk's fsync latency next to the POST latency, per second and overall."""
    by_sec: dict[int, list[float]] = {}
    for at, ms in samples:
        by_sec.setdefault(int(at - t0), []).append(ms)
    for bucket in summary["per_second"]:
        values = by_sec.get(int(bucket["second"]))
        if values:
            bucket["fsync_max_ms"] = round(max(values), 3)
    if samples:
        values = [ms for _, ms in samples]
        summary["fsync_probe_ms"] = {
            "n": len(values),
            "p50": percentile(values, 50),
            "p99": percentile(values, 99),
            "max": max(values),
        }


def queue_states(db: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return {
            str(s): int(n)
            for s, n in conn.execute("SELECT state, count(*) FROM jobs GROUP BY state")
        }


def _smtp_stats(record: Path, since: float) -> dict[str, Any]:
    rows = read_record(record)
    ids = [r[1] for r in rows]
    return {
        "messages": len(rows),
        "distinct_message_ids": len(set(ids)),
        "duplicates": len(ids) - len(set(ids)),
        "empty_message_ids": sum(1 for i in ids if not i),
        "elapsed_s": time.time() - since,
    }


def run(cfg: BacklogConfig, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    db = workdir / "backlog.db"
    record = workdir / "smtp-messages.tsv"
    record.unlink(missing_ok=True)
    out: dict[str, Any] = {
        "config": {
            "rate": cfg.rate,
            "duration_s": cfg.duration_s,
            "email_delay_s": cfg.email_delay_s,
            "workers": cfg.workers,
            "settle_s": cfg.settle_s,
            "p99_target_ms": cfg.p99_target_ms,
            "load_generator": "bench.loadgen (asyncio/aiohttp, open loop, constant rate)",
            "max_client_connections": cfg.max_connections,
        }
    }
    with smtp_sink(workdir, "smtp-slow", cfg.email_delay_s, record) as sink:
        target = toko_target(cfg.toko, db, workers=cfg.workers, smtp_url=sink.url)
        # Before toko-api starts, so only other tenants are measured.
        out["before"] = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
        with running(target, workdir / "toko-api.log") as api:
            cpu0 = cpu_snapshot(api.pid)
            t_start = time.time()
            print(
                f"  offering {cfg.rate:g} req/s for {cfg.duration_s:g} s "
                f"({int(cfg.rate * cfg.duration_s)} POSTs)...",
                flush=True,
            )
            fsyncs = FsyncMonitor(workdir)
            with fsyncs:
                load = asyncio.run(
                    open_loop(
                        target.base_url + "/produk",
                        rate=cfg.rate,
                        duration_s=cfg.duration_s,
                        token=f"backlog-{int(t_start)}",
                        max_connections=cfg.max_connections,
                    )
                )
            summary = load.summary()
            _add_fsync(summary, fsyncs.samples, load.t0_monotonic)
            summary["cpu"] = cpu = cpu_usage(cpu0, cpu_snapshot(api.pid))
            out["load"] = summary
            lat = summary.get("latency_ms", {})
            print(
                f"  load done: {summary['ok_201']}/{summary['requests']} x 201, "
                f"p50 {lat.get('p50', 0):.2f} ms, p99 {lat.get('p99', 0):.2f} ms, "
                f"max {lat.get('max', 0):.1f} ms; cpu%: toko {cpu['server_pct']:.0f}, "
                f"bench {cpu['bench_pct']:.0f}, others {cpu['others_pct']:.0f}",
                flush=True,
            )
            worst = sorted(summary["per_second"], key=lambda b: b["p99_ms"])[-3:]
            print(
                "  worst seconds, POST p99 / disk fsync max (ms): "
                + ", ".join(
                    f"t={b['second']}s {b['p99_ms']:.1f}/{b.get('fsync_max_ms', float('nan')):.1f}"
                    for b in reversed(worst)
                ),
                flush=True,
            )
            time.sleep(cfg.settle_s)
            q = inspect_queue(db)
            smtp = _smtp_stats(record, t_start)
            api.check_alive()
            # SIGTERM while jobs are in flight at the slow SMTP server: the
            # contract is exit 0 within TOKO_DRAIN_TIMEOUT (default 10 s).
            stop_t0 = time.monotonic()
            rc = api.stop(timeout=60)
            out["stop"] = {"exit_code": rc, "seconds": time.monotonic() - stop_t0}
    returned_ids = set(load.product_ids())
    db_ids: set[int] = q.pop("product_ids")
    q["ids_201_equal_db_ids"] = returned_ids == db_ids
    q["ids_201_not_in_db"] = len(returned_ids - db_ids)
    q["db_ids_not_returned"] = len(db_ids - returned_ids)
    out["queue_after_load"] = q
    expected_rate = cfg.workers / cfg.email_delay_s if cfg.email_delay_s > 0 else float("inf")
    smtp["rate_per_s"] = smtp["distinct_message_ids"] / smtp["elapsed_s"]
    smtp["expected_rate_per_s"] = expected_rate
    # Emails complete in waves of `workers` every `delay` seconds: allow one
    # wave either side, and 20 % for start-up and scheduling slack below.
    waves = smtp["elapsed_s"] / cfg.email_delay_s if cfg.email_delay_s > 0 else 0.0
    smtp["expected_min"] = int(0.8 * cfg.workers * (waves - 1))
    smtp["expected_max"] = int(cfg.workers * (waves + 1))
    out["smtp_during_load"] = smtp
    states_ok = set(q["states"]) <= {"pending", "running", "done"}
    checks = {
        "p99_ok": bool(lat) and lat["p99"] <= cfg.p99_target_ms,
        "zero_errors": summary["errors"] == 0 and summary["ok_201"] == summary["requests"],
        "one_job_per_product": (
            q["products_without_one_job"] == 0
            and q["jobs_without_product"] == 0
            and q["jobs_without_product_id_in_payload"] == 0
            and q["ids_201_equal_db_ids"]
            and states_ok
        ),
        # The backlog keeps every worker busy, so mail flows at workers/delay
        # once the first emails are through: well below means workers stalled.
        "drain_rate_ok": (
            smtp["expected_min"] <= smtp["distinct_message_ids"] <= smtp["expected_max"]
            and smtp["duplicates"] == 0
        ),
        "clean_stop": out["stop"]["exit_code"] == 0,
    }
    out["checks"] = checks
    if cfg.full_drain:
        out["full_drain"] = _full_drain(cfg, workdir, db, record, len(db_ids))
        checks["full_drain_ok"] = out["full_drain"]["all_delivered"]
    out["met"] = all(checks.values())
    return out


def _full_drain(
    cfg: BacklogConfig, workdir: Path, db: Path, record: Path, products: int
) -> dict[str, Any]:
    """Restart on the same database with an instant SMTP server; wait for every email."""
    before = _smtp_stats(record, time.time())["distinct_message_ids"]
    print(
        f"  full drain: {products - before} emails left, restarting with 0 s SMTP delay "
        f"(timeout {cfg.drain_timeout_s:g} s)...",
        flush=True,
    )
    t0 = time.monotonic()
    states: dict[str, int] = {}
    timed_out = False
    with smtp_sink(workdir, "smtp-fast", 0.0, record) as sink:
        target = toko_target(cfg.toko, db, workers=cfg.drain_workers, smtp_url=sink.url)
        with running(target, workdir / "toko-api-drain.log") as api:
            while True:
                api.check_alive()
                states = queue_states(db)
                left = states.get("pending", 0) + states.get("running", 0)
                if left == 0:
                    break
                if time.monotonic() - t0 > cfg.drain_timeout_s:
                    timed_out = True
                    break
                time.sleep(0.5)
            seconds = time.monotonic() - t0
            time.sleep(0.5)  # the last acks are committed after the 250
    stats = _smtp_stats(record, time.time())
    final = inspect_queue(db)
    final.pop("product_ids")
    return {
        "seconds": seconds,
        "timed_out": timed_out,
        "emails_before": before,
        "products": products,
        "distinct_message_ids": stats["distinct_message_ids"],
        "messages": stats["messages"],
        "duplicates": stats["duplicates"],
        "final_queue": final,
        "workers": cfg.drain_workers,
        "all_delivered": (
            not timed_out
            and stats["distinct_message_ids"] == products
            and final["states"] == {"done": products}
        ),
    }
