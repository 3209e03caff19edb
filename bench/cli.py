"""``python -m bench``: run the scenarios, print a table, write JSON and Markdown."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import (
    compare,
    loadgen,
    postfix,
    report,
    scenario_backlog,
    scenario_disk,
    scenario_email,
    scenario_peers,
    scenario_postgres,
    scenario_queue,
    scenario_startup,
    scenario_throughput,
    scenario_tutorial,
)
from bench.deployed import deployed_toko
from bench.procs import REPO, cpu_probe, fsync_probe, install_sigterm_as_interrupt, venv_bin
from bench.toko import TokoCommand, snapshot

SCENARIOS = (
    "throughput",
    "backlog",
    "startup",
    "postgres",
    "queue",
    "tutorial",
    "disk",
    "sink",
    "peers",
    "email",
)
ALIASES = {
    "a": "throughput",
    "b": "backlog",
    "c": "startup",
    "d": "postgres",
    "e": "queue",
    "f": "tutorial",
    "g": "disk",
    "h": "sink",
    "i": "peers",
    "j": "email",
    "all": "all",
}


def _ints(value: str) -> tuple[int, ...]:
    try:
        ints = tuple(int(v) for v in value.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {value!r}") from exc
    if min(ints) < 1:
        raise argparse.ArgumentTypeError(f"counts must be at least 1, got {value!r}")
    return ints


def _floats(value: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in value.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"comma-separated numbers, got {value!r}") from exc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Load benchmarks for toko-api on 127.0.0.1 with real processes. Scenarios: "
            "(a) throughput: wrk POST /produk at 1, 16, 64 and 256 connections, toko-api vs an "
            "in-memory aiohttp baseline; (b) backlog: constant-rate open-loop POSTs while every "
            "email takes 2 s, then proves no job was lost; (c) startup: spawn to READY=1 and idle "
            "RSS, installed as the package does (build/bench-deployed-venv) and in this venv; "
            "(d) postgres: POST throughput with one and two instances on PostgreSQL and "
            "jobs/s drained, beside SQLite; (e) queue: toko's queue against arq (Redis) and "
            "procrastinate (PostgreSQL): drains, enqueue-to-start latency, peak RSS; "
            "(f) tutorial: the tutorial's Go program against toko-api under the same load, "
            "plotted to docs/tutorial-latency.png; (g) disk: open-loop POSTs at 1,000 then "
            "2,000/s for 60 s each, 2 s emails, SQLite on the real disk then PostgreSQL, then "
            "the in-memory baseline, per 5 s window with the WAL's size and an fsync probe; "
            "(h) sink: the ceiling of Postfix's smtp-sink, the SMTP server email throughput is "
            "measured through, fed by its "
            "smtp-source; (i) peers: FastAPI + procrastinate and aiohttp + SQLite + arq doing "
            "toko's job beside toko on PostgreSQL and SQLite: POST req/s over connections, CPU "
            "per request, emails/s drained, with job workers running and parked, then the "
            "in-memory baseline as the ceiling; (j) email: a "
            "backlog of product emails drained by toko-api on one core into smtp-sink."
        ),
        epilog=(
            "Results: a table on stdout, bench/results/<timestamp>.json and "
            "bench/results/latest.md. Exit status 1 if a target is missed, 2 on a bench error."
        ),
    )
    p.add_argument(
        "-s",
        "--scenario",
        action="append",
        choices=[*SCENARIOS, *ALIASES],
        help="scenario to run (repeatable; a-j as short names; default: all)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="short durations to check the harness works (figures not meaningful)",
    )
    p.add_argument(
        "--toko-cmd",
        default=None,
        help="command starting the service (default: the venv's toko-api)",
    )
    p.add_argument(
        "--toko-ref",
        default=None,
        help="measure this git revision (extracted with git archive) instead of the working tree",
    )
    p.add_argument(
        "--quiet-below",
        type=float,
        default=40.0,
        metavar="PCT",
        help="before each measurement, wait (bounded) until other processes use less than PCT "
        "%% of one core (default 40; 0 = never wait)",
    )
    p.add_argument("--quiet-max-wait", type=float, default=15.0, help="seconds (default 15)")
    p.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="run nothing: print the table of a saved results file and write latest.md from it",
    )
    p.add_argument(
        "--compare",
        type=Path,
        nargs=2,
        metavar=("OLD", "NEW"),
        help="run nothing: print every figure two saved results files share, with NEW ÷ OLD",
    )
    p.add_argument(
        "--compare-match",
        default="",
        metavar="TEXT",
        help="with --compare: only figures whose path contains TEXT (e.g. queue.figures)",
    )
    p.add_argument(
        "--keep-dbs",
        action="store_true",
        help="keep the SQLite files of the runs (default: delete them, keep logs and JSON)",
    )
    p.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    g = p.add_argument_group("(a) throughput")
    g.add_argument("--runs", type=int, help="alternating rounds (default 3)")
    g.add_argument("--duration", type=float, help="seconds measured per run (default 10)")
    g.add_argument("--warmup", type=float, help="discarded seconds before each run (default 2)")
    g.add_argument(
        "--connections",
        type=int,
        default=16,
        help="the main level: its ratio, and the parked diagnostic (default 16)",
    )
    g.add_argument(
        "--sweep",
        type=_ints,
        metavar="N,N",
        help="connection counts both servers are measured at, alternating "
        "(default 1,16,64,256; smoke 1,16,256)",
    )
    g.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (default 1: 2 cores)")
    g.add_argument(
        "--parked",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure toko-api with its workers parked (diagnostic: ingest path only)",
    )
    g.add_argument(
        "--db-dir",
        type=Path,
        default=None,
        help="where toko-api's SQLite files go (diagnostic: /dev/shm takes fsync out)",
    )
    g = p.add_argument_group("(b) backlog")
    g.add_argument("--rate", type=float, default=500.0, help="offered POSTs per second")
    g.add_argument("--load-duration", type=float, help="seconds of load (default 30)")
    g.add_argument(
        "--email-delay", type=float, default=2.0, help="SMTP seconds per email (b and g)"
    )
    g.add_argument("--workers", type=int, default=3, help="TOKO_WORKERS (b and g)")
    g.add_argument("--p99-target", type=float, default=20.0, help="ms")
    g.add_argument(
        "--full-drain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="afterwards restart with an instant SMTP server and drain everything",
    )
    g.add_argument("--drain-timeout", type=float, default=420.0, help="seconds")
    g.add_argument("--drain-workers", type=int, default=16, help="TOKO_WORKERS for the drain")
    g = p.add_argument_group("(e) queue")
    g.add_argument("--queue-reps", type=int, help="repetitions per figure (default 3)")
    g.add_argument(
        "--queue-systems",
        default=",".join(scenario_queue.ALL_SYSTEMS),
        help="comma-separated systems (default: %(default)s)",
    )
    g = p.add_argument_group("(g) disk")
    g.add_argument(
        "--disk-rates",
        type=_floats,
        metavar="R,R",
        help="offered POSTs per second, one run each (default 1000,2000; smoke 200,400)",
    )
    g.add_argument("--disk-duration", type=float, help="seconds per rate (default 60; smoke 5)")
    g.add_argument("--disk-window", type=float, default=5.0, help="seconds per window")
    g.add_argument(
        "--disk-backends",
        type=lambda v: tuple(v.split(",")),
        default=scenario_disk.BACKENDS,
        metavar="B,B",
        help="sqlite, postgres and/or memory, the in-memory baseline (default: all three)",
    )
    g.add_argument(
        "--disk-generators",
        type=int,
        default=1,
        help="load generator processes sharing the schedule (default 1)",
    )
    g.add_argument(
        "--disk-client",
        choices=loadgen.CLIENTS,
        default="raw",
        help="the generator's HTTP client (default raw: bench.rawhttp, a third less CPU)",
    )
    g.add_argument(
        "--disk-p99-targets",
        type=_floats,
        default=None,
        metavar="MS,MS",
        help="p99 target per window, one per rate, the last repeated (default: the "
        "issue's, 5 ms up to 1,000/s and 20 ms above)",
    )
    g.add_argument("--disk-max-target", type=float, default=100.0, help="ms no request may exceed")
    g.add_argument(
        "--disk-trace",
        action="store_true",
        help="trace the machine with perf across each run and say, for every request of "
        "10 ms or more, whether the disk, a wait for a core, the generator's lateness or "
        "toko-api's own work held it (needs root and perf)",
    )
    g = p.add_argument_group("(i) peers")
    g.add_argument(
        "--peers-stacks",
        type=lambda v: tuple(v.split(",")),
        default=scenario_peers.DEFAULT_STACKS,
        metavar="S,S",
        help="stacks to run (default: %(default)s)",
    )
    g.add_argument(
        "--peers-connections",
        type=_ints,
        metavar="N,N",
        help="wrk connections swept per stack (default 1,16,64,256; smoke 16,64)",
    )
    g.add_argument("--peers-reps", type=int, help="alternating repetitions (default 2; smoke 1)")
    g.add_argument(
        "--peers-workers", type=int, default=16, help="job workers (concurrency) of every stack"
    )
    g.add_argument(
        "--peers-web-workers", type=int, default=2, help="uvicorn --workers of the FastAPI peer"
    )
    g = p.add_argument_group("(c) startup")
    g.add_argument("--starts", type=int, help="starts to take the median of (default 5)")
    g.add_argument("--idle", type=float, help="idle seconds before reading RSS (default 2)")
    args = p.parse_args(argv)
    chosen = [ALIASES.get(s, s) for s in (args.scenario or ["all"])]
    args.scenarios = list(SCENARIOS) if "all" in chosen else list(dict.fromkeys(chosen))
    smoke = args.smoke

    def pick(value: float | None, normal: float, short: float) -> float:
        return value if value is not None else (short if smoke else normal)

    args.runs = int(pick(args.runs, 3, 1))
    args.duration = pick(args.duration, 10, 2)
    args.warmup = pick(args.warmup, 2, 1)
    args.sweep = args.sweep or ((1, 16, 256) if smoke else (1, 16, 64, 256))
    args.load_duration = pick(args.load_duration, 30, 4)
    args.starts = int(pick(args.starts, 5, 2))
    args.idle = pick(args.idle, 2, 0.5)
    args.settle = 2.0 if smoke else 5.0
    return args


def _git_describe() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    py = platform.python_version()
    return f"{os.cpu_count()} x {model}, Linux {platform.release()}, Python {py}"


def _quiet(args: argparse.Namespace) -> dict[str, float]:
    return {
        "quiet_below_pct": args.quiet_below or float("inf"),
        "quiet_max_wait_s": args.quiet_max_wait,
    }


def _run_throughput(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    cfg = scenario_throughput.ThroughputConfig(
        toko=toko,
        runs=args.runs,
        duration_s=args.duration,
        warmup_s=args.warmup,
        connections=args.connections,
        sweep=args.sweep,
        threads=args.wrk_threads,
        parked=args.parked,
        db_dir=args.db_dir,
        **_quiet(args),
    )
    return scenario_throughput.run(cfg, out)


def _run_backlog(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    cfg = scenario_backlog.BacklogConfig(
        toko=toko,
        rate=args.rate,
        duration_s=args.load_duration,
        email_delay_s=args.email_delay,
        workers=args.workers,
        settle_s=args.settle,
        p99_target_ms=args.p99_target,
        full_drain=args.full_drain,
        drain_timeout_s=args.drain_timeout,
        drain_workers=args.drain_workers,
        quiet_below_pct=args.quiet_below or float("inf"),
        quiet_max_wait_s=2 * args.quiet_max_wait,
    )
    return scenario_backlog.run(cfg, out)


def _run_postgres(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    cfg = scenario_postgres.PostgresConfig(
        toko=toko,
        duration_s=args.duration,
        warmup_s=args.warmup,
        connections=args.connections,
        drain_jobs=500 if args.smoke else 5000,
        **_quiet(args),
    )
    return scenario_postgres.run(cfg, out)


def _run_queue(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    cfg = scenario_queue.QueueConfig(systems=tuple(args.queue_systems.split(",")), **_quiet(args))
    cfg = cfg.smoke() if args.smoke else cfg
    if args.queue_reps:
        cfg = replace(cfg, reps=args.queue_reps)
    return scenario_queue.run(cfg, out)


def _run_tutorial(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    # The Go build cache outlives the run: a cold build takes 25-60 s.
    go_cache = args.results_dir / ".go-cache"
    if args.smoke:
        cfg = scenario_tutorial.TutorialConfig.smoke(toko, go_cache_dir=go_cache)
    else:
        cfg = scenario_tutorial.TutorialConfig(
            toko=toko, go_cache_dir=go_cache, quiet_below_pct=args.quiet_below or float("inf")
        )
    return scenario_tutorial.run(cfg, out)


def _run_disk(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    overrides: dict[str, Any] = {
        "backends": args.disk_backends,
        "window_s": args.disk_window,
        "email_delay_s": args.email_delay,
        "workers": args.workers,
        "generators": args.disk_generators,
        "client": args.disk_client,
        "p99_targets_ms": args.disk_p99_targets,
        "max_target_ms": args.disk_max_target,
        "trace": args.disk_trace,
        **_quiet(args),
    }
    if args.disk_rates:
        overrides["rates"] = args.disk_rates
    if args.disk_duration:
        overrides["duration_s"] = args.disk_duration
    # The targets are for toko-api as the package installs it, as in (c).
    toko = _package_style(args) or toko
    if args.smoke:
        cfg = scenario_disk.DiskConfig.smoke(toko, **overrides)
    else:
        cfg = scenario_disk.DiskConfig(toko=toko, **overrides)
    return scenario_disk.run(cfg, out)


def _run_sink(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    if args.smoke:
        cfg = postfix.CeilingConfig.smoke(**_quiet(args))
    else:
        cfg = postfix.CeilingConfig(**_quiet(args))
    return postfix.measure_ceiling(cfg, out)


def _run_peers(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    cfg = scenario_peers.PeersConfig(
        toko=toko,
        stacks=args.peers_stacks,
        workers=args.peers_workers,
        web_workers=args.peers_web_workers,
        **_quiet(args),
    )
    cfg = cfg.smoke() if args.smoke else cfg
    if args.peers_connections:
        cfg = replace(cfg, connections=args.peers_connections)
    if args.peers_reps:
        cfg = replace(cfg, reps=args.peers_reps)
    return scenario_peers.run(cfg, out)


def _run_email(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    if args.smoke:
        cfg = scenario_email.EmailConfig.smoke(toko, **_quiet(args))
    else:
        cfg = scenario_email.EmailConfig(toko=toko, **_quiet(args))
    return scenario_email.run(cfg, out)


def _run_startup(args: argparse.Namespace, toko: TokoCommand, out: Path) -> Any:
    cfg = scenario_startup.StartupConfig(toko=toko, starts=args.starts, idle_s=args.idle)
    if args.toko_ref or args.toko_cmd:
        return scenario_startup.run_installs(cfg, [("the toko-api given", toko)], out)
    developers = ("developers' venv (editable)", toko)
    packaged = _package_style(args)
    if packaged is None:
        return scenario_startup.run_installs(cfg, [developers], out, targeted=False)
    installs = [("installed as the package does", packaged), developers]
    return scenario_startup.run_installs(cfg, installs, out)


def _package_style(args: argparse.Namespace) -> TokoCommand | None:
    """toko-api installed as the Debian package installs it (bench.deployed), unless
    --toko-ref or --toko-cmd named what to measure; None where it cannot be made."""
    if args.toko_ref or args.toko_cmd:
        return None
    try:
        return deployed_toko(REPO, REPO / "build" / "bench-deployed-venv")
    except subprocess.CalledProcessError as exc:
        # The developers' venv is still worth its figures; say why it is alone.
        print(f"  cannot make the package-style venv ({exc}): this venv only", flush=True)
        return None


RUNNERS = {
    "throughput": _run_throughput,
    "backlog": _run_backlog,
    "startup": _run_startup,
    "postgres": _run_postgres,
    "queue": _run_queue,
    "tutorial": _run_tutorial,
    "disk": _run_disk,
    "sink": _run_sink,
    "peers": _run_peers,
    "email": _run_email,
}
assert tuple(RUNNERS) == SCENARIOS


def _toko_under_test(args: argparse.Namespace) -> tuple[TokoCommand, Path | None]:
    """The toko-api to measure, and the snapshot folder to remove afterwards."""
    if not args.toko_ref:
        toko_argv = shlex.split(args.toko_cmd) if args.toko_cmd else [str(venv_bin("toko-api"))]
        return TokoCommand(toko_argv, revision=_git_describe()), None
    # Outside the repository, so linters and type checkers never see it.
    snapdir = Path(tempfile.mkdtemp(prefix="toko-bench-snapshot-"))
    try:
        return snapshot(args.toko_ref, snapdir), snapdir
    except subprocess.CalledProcessError:
        shutil.rmtree(snapdir, ignore_errors=True)
        raise


def _render_saved(args: argparse.Namespace) -> int:
    saved = json.loads(args.render.read_text())
    print(report.text_table(saved))
    md = args.results_dir / "latest.md"
    md.write_text(report.markdown(saved))
    print(f"\nbench: wrote {md} from {args.render}")
    return 0


def _missed(results: dict[str, Any]) -> list[str]:
    # (a) has no pass/fail line since issue 34: its ratios are reported.
    return [
        n
        for n in ("backlog", "startup", "postgres", "queue", "disk", "peers", "email")
        if n in results and not results[n].get("met", True)
    ]


def _remove_databases(workdir: Path) -> None:
    # Tens of MB per run (WAL included); the figures are in the JSON.
    for pattern in ("*.db", "*.db-wal", "*.db-shm", "*.db.lock"):
        for path in workdir.rglob(pattern):
            path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        print(compare.render(*args.compare, match=args.compare_match))
        return 0
    if args.render:
        return _render_saved(args)
    install_sigterm_as_interrupt()
    started = datetime.now(UTC)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    results_dir: Path = args.results_dir
    workdir = results_dir / f"{stamp}-work"
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        toko, snapdir = _toko_under_test(args)
    except subprocess.CalledProcessError as exc:
        print(f"bench: cannot extract {args.toko_ref}: {exc.stderr}", file=sys.stderr)
        return 2
    if not shutil.which(toko.argv[0]):
        print(f"bench: {toko.argv[0]} not found or not executable", file=sys.stderr)
        return 2
    if "throughput" in args.scenarios and not shutil.which("wrk"):
        print("bench: wrk not found (apt-get install wrk; make bench does it)", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "meta": {
            "started": started.isoformat(timespec="seconds"),
            "command": "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": _machine(),
            "git": toko.revision,
            "loadavg_before": os.getloadavg(),
            "fsync_before": fsync_probe(workdir),
            "cpu_probe_before": cpu_probe(),
            "toko_cmd": toko.argv,
            "smoke": args.smoke,
            "workdir": str(workdir),
        }
    }
    print(f"bench: logs and databases in {workdir}", flush=True)
    print(f"bench: {report.machine_speed(results['meta'])}", flush=True)
    failed: list[str] = []
    try:
        for name in args.scenarios:
            print(f"== {name}", flush=True)
            t0 = time.monotonic()
            try:
                results[name] = RUNNERS[name](args, toko, workdir / name)
            except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
                # One scenario failing should not cost the others' figures.
                traceback.print_exc()
                results[name + "_error"] = f"{type(exc).__name__}: {exc}"
                failed.append(name)
            print(f"   ({time.monotonic() - t0:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("\nbench: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    finally:
        results["meta"]["loadavg_after"] = os.getloadavg()
        results["meta"]["fsync_after"] = fsync_probe(workdir)
        results["meta"]["cpu_probe_after"] = cpu_probe()
        _write(results, results_dir, stamp)
        if snapdir is not None:
            shutil.rmtree(snapdir, ignore_errors=True)
        if not args.keep_dbs:
            _remove_databases(workdir)
    if failed:
        print(f"bench: scenario(s) failed to run: {', '.join(failed)}", file=sys.stderr)
        return 2
    if missed := _missed(results):
        print(f"bench: target(s) missed: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


def _write(results: dict[str, Any], results_dir: Path, stamp: str) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{stamp}.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    table = report.text_table(results)
    print()
    print(table)
    print(f"\nbench: wrote {path}")
    if not results["meta"]["smoke"]:
        md = results_dir / "latest.md"
        md.write_text(report.markdown(results))
        print(f"bench: wrote {md}")
