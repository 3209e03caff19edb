"""(a) Durable POST /produk throughput: toko-api vs the in-memory baseline, with wrk.

Each round measures both servers at every concurrency of the sweep (1, 16,
64 and 256 connections by default), starting each server fresh for each
measurement (toko-api on a new SQLite file, log mailer), one after the
other, rotating which level and which server goes first so slow drift on a
shared machine does not favour one side. Each measurement is preceded by a
short, discarded warm-up. Each server's peak is its best median over the
levels; the ratio of the peaks is reported beside the ratio at the main
level (``connections``, 16), where the rounds' top-level entries stay.

A third, diagnostic target (``toko-parked``) runs toko-api with its workers
parked on an SMTP server that never answers in time: the same HTTP +
group-commit path without any job processing. Comparing it with ``toko``
tells how much of the gap to the baseline is the ingest path and how much is
the workers running jobs on the same event loop. It is not part of the target.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import (
    Managed,
    cpu_snapshot,
    cpu_usage,
    wait_for_quiet,
)
from bench.sink import smtp_sink
from bench.stats import Spread, fmt_spread, spread
from bench.toko import (
    Target,
    TokoCommand,
    baseline_target,
    group_commit_factor,
    running,
    toko_target,
)
from bench.wrk import POST_PRODUK_LUA, WrkResult, run_wrk


@dataclass(frozen=True)
class ThroughputConfig:
    toko: TokoCommand
    runs: int = 3
    duration_s: float = 10.0
    warmup_s: float = 2.0
    connections: int = 16  # the main level: the parked diagnostic runs here
    sweep: tuple[int, ...] = (1, 16, 64, 256)
    threads: int = 1
    parked: bool = True
    quiet_below_pct: float = 40.0  # wait for other tenants to calm down first...
    quiet_max_wait_s: float = 15.0  # ...but not for longer than this
    db_dir: Path | None = None  # e.g. /dev/shm to take the disk out (diagnostic)


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
    connections: int,
    before_stop: Callable[[], object] | None = None,
) -> tuple[WrkResult, dict[str, Any]]:
    url = target.base_url + "/produk"
    wrk_log = workdir / "wrk.log"
    threads = min(cfg.threads, connections)  # wrk wants a connection per thread at least
    with running(target, workdir / f"{label}.log", stop_timeout=30) as proc:
        if cfg.warmup_s > 0:
            run_wrk(
                url,
                script=script,
                duration_s=cfg.warmup_s,
                connections=connections,
                threads=threads,
                token=f"{label}-warm",
                log=wrk_log,
            )
        cpu0 = cpu_snapshot(proc.pid)
        result = run_wrk(
            url,
            script=script,
            duration_s=cfg.duration_s,
            connections=connections,
            threads=threads,
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
        "connections": connections,
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
    connections: int,
    before_stop: Callable[[], object] | None = None,
) -> tuple[WrkResult, dict[str, Any]]:
    """On this shared machine something else may signal our server: retry once, loudly."""
    try:
        return _measure(target, cfg, workdir, label, script, connections, before_stop)
    except Disturbed as exc:
        print(f"  {label}: {exc}; measuring again", flush=True)
        return _measure(target, cfg, workdir, label + "-retry", script, connections, before_stop)


def levels(cfg: ThroughputConfig) -> list[int]:
    """The sweep's connection counts, the main level always among them."""
    return sorted({*cfg.sweep, cfg.connections})


def _rotated(items: list[str] | list[int], by: int) -> list[Any]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def _one(
    cfg: ThroughputConfig, workdir: Path, label: str, which: str, connections: int, script: Path
) -> dict[str, Any]:
    """Start ``which`` fresh, measure it at ``connections``, stop it: the round's entry."""
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
        res, extra = _measure_retrying(
            target, cfg, workdir, label, script, connections, before_stop
        )
    entry = res.to_json() | extra | {"before": quiet}
    if db is not None:
        # Warm-up and measured requests all committed a row.
        entry["rows_in_db"] = count_products(db)
        entry["group_commit"] = group_commit_factor(workdir / f"{label}.log")
        if cfg.db_dir is not None:
            for leftover in cfg.db_dir.glob(db.name + "*"):
                leftover.unlink()
    cpu = extra["cpu"]
    print(
        f"  round {label.split('-', 1)[0][1:]} {which:11s} {connections:4d} conns"
        f" {res.rps:8.0f} req/s  p50 {res.latency_ms['p50']:.2f} ms"
        f"  p99 {res.latency_ms['p99']:.2f} ms  errors {res.error_count}  cpu%: server"
        f" {cpu['server_pct']:.0f}, wrk {cpu['children_pct']:.0f}, others {cpu['others_pct']:.0f}"
        + (
            f"; writes/commit {entry['group_commit']['writes_per_commit']:.1f}"
            if entry.get("group_commit")
            else ""
        ),
        flush=True,
    )
    return entry


def entry_at(rnd: dict[str, Any], main: int, connections: int, which: str) -> dict[str, Any]:
    """A round's entry for ``which`` at ``connections`` (the main level's at the top)."""
    if connections == main:
        return dict(rnd[which])
    return dict(rnd["sweep"][str(connections)][which])


def cpu_us_per_request(entry: dict[str, Any]) -> float | None:
    cpu, rps = entry.get("cpu"), entry.get("rps")
    if not cpu or not rps:
        return None
    return float(cpu["server_pct"]) / 100 / float(rps) * 1e6


def sweep_summary(rounds: list[dict[str, Any]], main: int, conns: list[int]) -> dict[str, Any]:
    """Per level and server: req/s, p50, p99, errors, CPU per request; the peaks and their ratio."""
    per_level: dict[str, Any] = {}
    for c in conns:
        level: dict[str, Any] = {}
        for which in ("toko", "baseline"):
            es = [entry_at(r, main, c, which) for r in rounds]
            costs = [v for e in es if (v := cpu_us_per_request(e)) is not None]
            level[which] = {
                "rps": spread([e["rps"] for e in es]),
                "p50_ms": spread([e["latency_ms"]["p50"] for e in es]),
                "p99_ms": spread([e["latency_ms"]["p99"] for e in es]),
                "errors": sum(e["error_count"] for e in es),
                "cpu_us_per_request": spread(costs) if costs else None,
            }
        level["ratio_per_round"] = spread(
            [
                entry_at(r, main, c, "toko")["rps"] / entry_at(r, main, c, "baseline")["rps"]
                for r in rounds
            ]
        )
        per_level[str(c)] = level
    peak: dict[str, Any] = {}
    for which in ("toko", "baseline"):
        medians = {c: float(per_level[str(c)][which]["rps"]["median"]) for c in conns}
        best = max(conns, key=medians.__getitem__)
        peak[which] = {"connections": best, "rps": per_level[str(best)][which]["rps"]}
    peak["ratio_of_peaks"] = peak["toko"]["rps"]["median"] / peak["baseline"]["rps"]["median"]

    def best_rps(rnd: dict[str, Any], which: str) -> float:
        return max(float(entry_at(rnd, main, c, which)["rps"]) for c in conns)

    # Each round's own peaks, wherever they fell: how much the ratio of peaks moves.
    peak["ratio_of_peaks_per_round"] = spread(
        [best_rps(r, "toko") / best_rps(r, "baseline") for r in rounds]
    )
    return {"levels": per_level, "peak": peak}


def run(cfg: ThroughputConfig, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "post_produk.lua"
    script.write_text(POST_PRODUK_LUA)
    rounds: list[dict[str, Any]] = []
    names = ["toko", "baseline", *(["toko-parked"] if cfg.parked else [])]
    conns = levels(cfg)
    main = cfg.connections
    for i in range(cfg.runs):
        rnd: dict[str, Any] = {"round": i + 1, "order": [], "sweep": {}}
        for c in _rotated(conns, i):
            for which in _rotated(names if c == main else ["toko", "baseline"], i):
                # The main level keeps the labels (and log names) it always had.
                label = f"r{i + 1}-{which}" if c == main else f"r{i + 1}-c{c}-{which}"
                entry = _one(cfg, workdir, label, which, c, script)
                rnd["order"].append(f"{which}@{c}")
                if c == main:
                    rnd[which] = entry
                else:
                    rnd["sweep"].setdefault(str(c), {})[which] = entry
        rnd["ratio"] = rnd["toko"]["rps"] / rnd["baseline"]["rps"]
        for level in rnd["sweep"].values():
            level["ratio"] = level["toko"]["rps"] / level["baseline"]["rps"]
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
    # No pass/fail line any more (issue 34): the ratios are reported.
    summary["sweep"] = sweep_summary(rounds, main, conns)
    return {
        "config": {
            "runs": cfg.runs,
            "duration_s": cfg.duration_s,
            "warmup_s": cfg.warmup_s,
            "connections": cfg.connections,
            "sweep": conns,
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


def _cost(s: Spread | None) -> str:
    return fmt_spread(s, "{:.0f}", " µs") if s else "n/a"


def sweep_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows for bench.report: each level, then the peaks (empty for runs before the sweep)."""
    sweep = result["summary"].get("sweep")
    if not sweep:
        return []
    c = result["config"]
    out: list[tuple[str, str, str, str]] = []
    for conns, level in sweep["levels"].items():
        t, b = level["toko"], level["baseline"]
        out.append(
            (
                f"(a) {conns} connections",
                f"toko-api · baseline req/s (p99), toko ÷ baseline, median of {c['runs']}"
                f" x {c['duration_s']:g} s",
                f"{fmt_spread(t['rps'])} ({t['p99_ms']['median']:.2f} ms) · "
                f"{fmt_spread(b['rps'])} ({b['p99_ms']['median']:.2f} ms) · "
                f"{fmt_spread(level['ratio_per_round'], '{:.2f}')}"
                + (
                    f" · errors {t['errors']} · {b['errors']}" if t["errors"] or b["errors"] else ""
                ),
                "",
            )
        )
    p = sweep["peak"]
    out.append(
        (
            "(a) peaks",
            "toko-api · baseline peak req/s (at connections) · ratio of peaks; of each round's",
            f"{fmt_spread(p['toko']['rps'])} ({p['toko']['connections']}) · "
            f"{fmt_spread(p['baseline']['rps'])} ({p['baseline']['connections']}) · "
            f"{p['ratio_of_peaks']:.2f}; {fmt_spread(p['ratio_of_peaks_per_round'], '{:.2f}')}",
            "",
        )
    )
    return out


def sweep_markdown(result: dict[str, Any]) -> list[str]:
    """The over-concurrency table and the peaks, for bench.report.markdown."""
    sweep = result["summary"].get("sweep")
    if not sweep:
        return []
    c, s = result["config"], result["summary"]
    out = [
        f"**(a) over concurrency**: both servers at each level, alternating, {c['runs']}"
        f" rounds of {c['duration_s']:g} s, each server started afresh for each measurement:",
        "",
        "| Connections | toko-api req/s | p50 · p99 | CPU per request"
        " | baseline req/s | p50 · p99 | CPU per request | toko ÷ baseline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    errors = []
    for conns, level in sweep["levels"].items():
        cells = [conns]
        for which in ("toko", "baseline"):
            w = level[which]
            cells += [
                fmt_spread(w["rps"]),
                f"{w['p50_ms']['median']:.2f} · {w['p99_ms']['median']:.2f} ms",
                _cost(w.get("cpu_us_per_request")),
            ]
            if w["errors"]:
                errors.append(f"{w['errors']} for {which} at {conns}")
        cells.append(fmt_spread(level["ratio_per_round"], "{:.2f}"))
        out.append("| " + " | ".join(cells) + " |")
    p = sweep["peak"]
    main = s["ratio_per_round"]
    out += [
        "",
        f"Peaks: toko-api {fmt_spread(p['toko']['rps'])} req/s at"
        f" {p['toko']['connections']} connections, the baseline"
        f" {fmt_spread(p['baseline']['rps'])} at {p['baseline']['connections']}."
        f" Ratio of peaks: **{p['ratio_of_peaks']:.2f}**; taking each round's own peaks,"
        f" {fmt_spread(p['ratio_of_peaks_per_round'], '{:.2f}')}. At {c['connections']}"
        f" connections: **{fmt_spread(main, '{:.2f}')}**."
        + (f" Request errors: {', '.join(errors)}." if errors else " No request errors."),
        "",
    ]
    return out
