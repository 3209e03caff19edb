"""(a) Durable POST /produk throughput: toko-api vs the in-memory baseline, with wrk.

Each round starts every server fresh (toko-api on a new SQLite file, log
mailer), one after the other, rotating which goes first so slow drift on a
shared machine does not favour one side. Each measurement is preceded by a
short, discarded warm-up.

A third, diagnostic target (``toko-parked``) runs toko-api with its workers
parked on an SMTP server that never answers in time: the same HTTP +
group-commit path without any job processing. Comparing it with ``toko``
tells how much of the gap to the baseline is the ingest path and how much is
the workers running jobs on the same event loop. It is not part of the target.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import (
    Managed,
    base_env,
    cpu_snapshot,
    cpu_usage,
    free_port,
    wait_for_quiet,
)
from bench.sink import smtp_sink
from bench.stats import median, spread
from bench.toko import Target, TokoCommand, running, toko_target
from bench.wrk import POST_PRODUK_LUA, WrkResult, run_wrk


@dataclass(frozen=True)
class ThroughputConfig:
    toko: TokoCommand
    runs: int = 3
    duration_s: float = 10.0
    warmup_s: float = 2.0
    connections: int = 16
    threads: int = 1
    parked: bool = True
    quiet_below_pct: float = 40.0  # wait for other tenants to calm down first...
    quiet_max_wait_s: float = 15.0  # ...but not for longer than this
    db_dir: Path | None = None  # e.g. /dev/shm to take the disk out (diagnostic)


def baseline_target() -> Target:
    port = free_port()
    cmd = [sys.executable, "-m", "bench.baseline_app", "--listen", f"127.0.0.1:{port}"]
    return Target("baseline", cmd, base_env(), port)


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


def count_products(db: Path) -> int | None:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
            return int(conn.execute("SELECT count(*) FROM products").fetchone()[0])
    except sqlite3.Error:
        return None


class Disturbed(RuntimeError):
    """The server stopped during a measurement without the bench asking."""


def _stopped_early(proc: Managed) -> bool:
    # toko-api logs "stopping" when it gets SIGTERM/SIGINT; the bench sends
    # that only after the measurement, so an earlier one came from outside.
    return proc.proc.poll() is not None or '"message": "stopping"' in proc.tail(50)


def _measure(
    target: Target,
    cfg: ThroughputConfig,
    workdir: Path,
    label: str,
    script: Path,
    before_stop: Callable[[], object] | None = None,
) -> tuple[WrkResult, dict[str, Any]]:
    url = target.base_url + "/produk"
    wrk_log = workdir / "wrk.log"
    with running(target, workdir / f"{label}.log", stop_timeout=30) as proc:
        if cfg.warmup_s > 0:
            run_wrk(
                url,
                script=script,
                duration_s=cfg.warmup_s,
                connections=cfg.connections,
                threads=cfg.threads,
                token=f"{label}-warm",
                log=wrk_log,
            )
        cpu0 = cpu_snapshot(proc.pid)
        result = run_wrk(
            url,
            script=script,
            duration_s=cfg.duration_s,
            connections=cfg.connections,
            threads=cfg.threads,
            token=label,
            log=wrk_log,
        )
        cpu = cpu_usage(cpu0, cpu_snapshot(proc.pid))
        if _stopped_early(proc):
            raise Disturbed(f"{target.name} stopped during the measurement (signal from outside?)")
        if before_stop is not None:
            before_stop()
        rc = proc.stop()
    extra = {
        "stop": {"exit_code": rc, "stop_s": proc.stop_seconds, "killed": proc.killed},
        "cpu": cpu,
    }
    return result, extra


def _measure_retrying(
    target: Target,
    cfg: ThroughputConfig,
    workdir: Path,
    label: str,
    script: Path,
    before_stop: Callable[[], object] | None = None,
) -> tuple[WrkResult, dict[str, Any]]:
    """On this shared machine something else may signal our server: retry once, loudly."""
    try:
        return _measure(target, cfg, workdir, label, script, before_stop)
    except Disturbed as exc:
        print(f"  {label}: {exc}; measuring again", flush=True)
        return _measure(target, cfg, workdir, label + "-retry", script, before_stop)


def run(cfg: ThroughputConfig, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "post_produk.lua"
    script.write_text(POST_PRODUK_LUA)
    rounds: list[dict[str, Any]] = []
    names = ["toko", "baseline", *(["toko-parked"] if cfg.parked else [])]
    for i in range(cfg.runs):
        order = names[i % len(names) :] + names[: i % len(names)]
        rnd: dict[str, Any] = {"round": i + 1, "order": order}
        for which in order:
            label = f"r{i + 1}-{which}"
            toko_db = workdir / f"{label}.db"
            if cfg.db_dir is not None:
                toko_db = cfg.db_dir / f"toko-bench-{workdir.parent.name}-{label}.db"
            db = None if which == "baseline" else toko_db
            before_stop: Callable[[], object] | None = None
            with contextlib.ExitStack() as stack:
                if which == "toko":
                    target = toko_target(cfg.toko, toko_db)
                elif which == "toko-parked":
                    # Each worker takes one job and waits on DATA for an hour.
                    # The SMTP server is stopped before toko-api so the stop
                    # is not held up by sends in flight.
                    sink = stack.enter_context(
                        smtp_sink(workdir, f"{label}-smtp", 3600.0, workdir / "parked.tsv")
                    )
                    target = toko_target(
                        cfg.toko,
                        toko_db,
                        smtp_url=sink.url,
                        extra_env={"TOKO_DRAIN_TIMEOUT": "1", "TOKO_JOB_TIMEOUT": "3600"},
                    )
                    before_stop = sink.proc.stop
                else:
                    target = baseline_target()
                quiet = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
                res, extra = _measure_retrying(target, cfg, workdir, label, script, before_stop)
            entry = res.to_json() | extra | {"before": quiet}
            if db is not None:
                # Warm-up and measured requests all committed a row.
                entry["rows_in_db"] = count_products(db)
                entry["group_commit"] = group_commit_factor(workdir / f"{label}.log")
                if cfg.db_dir is not None:
                    for leftover in cfg.db_dir.glob(db.name + "*"):
                        leftover.unlink()
            rnd[which] = entry
            cpu = extra["cpu"]
            print(
                f"  round {i + 1} {which:11s} {res.rps:8.0f} req/s  "
                f"p50 {res.latency_ms['p50']:.2f} ms  p99 {res.latency_ms['p99']:.2f} ms  "
                f"errors {res.error_count}  cpu%: server {cpu['server_pct']:.0f}, "
                f"wrk {cpu['children_pct']:.0f}, others {cpu['others_pct']:.0f}"
                + (
                    f"; writes/commit {entry['group_commit']['writes_per_commit']:.1f}"
                    if entry.get("group_commit")
                    else ""
                ),
                flush=True,
            )
        rnd["ratio"] = rnd["toko"]["rps"] / rnd["baseline"]["rps"]
        rounds.append(rnd)

    def col(which: str, key: str) -> list[float]:
        return [r[which][key] for r in rounds]

    def lat(which: str, key: str) -> list[float]:
        return [r[which]["latency_ms"][key] for r in rounds]

    summary: dict[str, Any] = {}
    for which in names:
        summary[which] = {
            "rps": spread(col(which, "rps")),
            "p50_ms": spread(lat(which, "p50")),
            "p99_ms": spread(lat(which, "p99")),
            "errors": sum(r[which]["error_count"] for r in rounds),
        }
    ratios = [r["ratio"] for r in rounds]
    summary["ratio_of_medians"] = (
        summary["toko"]["rps"]["median"] / summary["baseline"]["rps"]["median"]
    )
    summary["ratio_per_round"] = spread(ratios)
    if cfg.parked:
        summary["parked_ratio_per_round"] = spread(
            [r["toko-parked"]["rps"] / r["baseline"]["rps"] for r in rounds]
        )
    summary["target_ratio"] = 0.6
    summary["met"] = bool(median(ratios) >= 0.6 and summary["toko"]["errors"] == 0)
    return {
        "config": {
            "runs": cfg.runs,
            "duration_s": cfg.duration_s,
            "warmup_s": cfg.warmup_s,
            "connections": cfg.connections,
            "wrk_threads": cfg.threads,
            "quiet_below_pct": cfg.quiet_below_pct,
            "quiet_max_wait_s": cfg.quiet_max_wait_s,
            "db_dir": str(cfg.db_dir) if cfg.db_dir else "results work dir",
            "toko_cmd": cfg.toko.argv,
            "toko_revision": cfg.toko.revision,
            "targets": names,
        },
        "rounds": rounds,
        "summary": summary,
    }
