"""(i) Peer stacks doing toko's job: store a product, durably, with the job that emails it.

Four stacks in one run, each a set of real processes on 127.0.0.1, and a
reference:

- **toko, PostgreSQL** and **toko, SQLite**: toko-api of the working tree
  (bench.toko), ``TOKO_WORKERS`` = ``workers``;
- **FastAPI + procrastinate** (bench.peer_fastapi): uvicorn with ``web_workers``
  processes, a psycopg pool of ``pool_size`` each, the job deferred in the
  product's transaction; one ``procrastinate worker`` process at concurrency
  ``workers``. Compared with toko on PostgreSQL (the same throwaway cluster,
  tests.support.postgres, fsync on);
- **aiohttp + SQLite + arq** (bench.peer_arq): one aiohttp process, the
  product committed in SQLite, then the job enqueued to Redis (not atomic);
  one ``arq`` worker process with ``max_jobs`` = ``workers``. Redis is
  Debian's, with its append-only file on (``appendfsync everysec``, Redis's
  durable setting). Compared with toko on SQLite;
- **the in-memory handler** (bench.baseline_app, scenario (a)'s): toko's HTTP
  work, no store, no jobs. Not a peer and not counted: its req/s over a
  peer's is the most that any server in one Python process answers here, so
  a toko ÷ peer target above it is out of reach of toko's design, measured
  in the same run. It runs parked only, having no workers.

Each stack runs under two conditions: **running**, its job workers sending
email during the POST load (one server, as deployed), and **parked**, its
workers not started during the load, then started for the drain. toko has no
switch for "no workers": parked, it runs one worker that an SMTP server which
never answers holds on the first job, and for the drain it is restarted with
``workers`` workers (the held job is retried there).

Per stack and condition: a discarded warm-up at 16 connections, then wrk at
each of ``connections`` (req/s, p50, p99, errors), the CPU of every process
of the stack (web server and its children, job worker, PostgreSQL's server
processes or Redis) per request, and the other processes' CPU. Then the
drain: emails/s that the stack's own workers deliver to the SMTP server
(Postfix's smtp-sink, bench.postfix), between 10 % and 90 % of the backlog
left when the load ended, for at most ``drain_s`` (then over what was
delivered). The stacks alternate, rotating per repetition; the ratios toko ÷
peer pair the figures of one repetition.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.postfix import PostfixSink, postfix_sink
from bench.procs import (
    base_env,
    cpu_snapshot,
    free_port,
    managed,
    wait_for_quiet,
)
from bench.redis_server import RedisServer, flush_redis, redis_server
from bench.sink import smtp_sink
from bench.stats import Spread, fmt_spread, spread
from bench.toko import Target, TokoCommand, baseline_target, running, toko_target
from bench.wrk import POST_PRODUK_LUA, WrkResult, run_wrk

TOKO_PG, FASTAPI, TOKO_SQLITE, ARQ = "toko-postgres", "fastapi", "toko-sqlite", "aiohttp-arq"
MEMORY = "memory"
STACKS = (TOKO_PG, FASTAPI, TOKO_SQLITE, ARQ)
PEERS = (FASTAPI, ARQ)
DEFAULT_STACKS = (*STACKS, MEMORY)
NAMES = {
    TOKO_PG: "toko, PostgreSQL",
    FASTAPI: "FastAPI + procrastinate (PostgreSQL)",
    TOKO_SQLITE: "toko, SQLite",
    ARQ: "aiohttp + SQLite + arq (Redis), not atomic",
    MEMORY: "in-memory handler, stores nothing (not counted)",
}
PAIRS = ((TOKO_PG, FASTAPI), (TOKO_SQLITE, ARQ))
CONDITIONS = ("running", "parked")
CONDITION_NAMES = {"running": "workers running", "parked": "workers parked"}
# The numbering of the two conditions.
CONDITION_NUMBERS = {"running": "(i)", "parked": "(ii)"}
# toko ÷ peer, req/s at REFERENCE connections: the targets.
TARGETS = {"running": 6.0, "parked": 3.0}
REFERENCE = 16
# Where a stack's set-up differs from what its documentation shows, and why.
DIFFERENCES = {
    TOKO_PG: "`TOKO_LOG_LEVEL=warning` (every stack logs warnings only)",
    FASTAPI: "uvicorn's access log off and procrastinate's log at warning (every stack logs "
    "warnings only); the worker's pool sized to its concurrency + 2 (procrastinate's "
    "default pool of 4 would starve it); emails sent with `aiosmtplib.send`, one SMTP "
    "connection per email as its docs show (toko keeps connections open)",
    TOKO_SQLITE: "`TOKO_LOG_LEVEL=warning` (every stack logs warnings only)",
    ARQ: "the product commits, then the job goes to Redis (a crash in between loses its "
    "email); Redis's append-only "
    "file on with `appendfsync everysec` (arq's docs leave persistence to Redis; the "
    "Debian default keeps jobs only in memory); arq's CLI log at warning "
    "(`--custom-log-dict`; its default logs two lines per job); one SMTP connection per "
    "email (`aiosmtplib.send`)",
    MEMORY: "not a peer: scenario (a)'s handler, the same HTTP work with a list for a store "
    "and no jobs, run parked only (it has no workers)",
}


@dataclass(frozen=True)
class PeersConfig:
    toko: TokoCommand
    connections: tuple[int, ...] = (1, 16, 64, 256)
    duration_s: float = 8.0
    warmup_s: float = 2.0
    reps: int = 2
    workers: int = 16
    web_workers: int = 2  # uvicorn --workers: one per core
    pool_size: int = 8  # the FastAPI peer's psycopg pool, per uvicorn worker
    drain_s: float = 20.0
    stacks: tuple[str, ...] = DEFAULT_STACKS
    conditions: tuple[str, ...] = CONDITIONS
    threads: int = 1
    quiet_below_pct: float = 40.0
    quiet_max_wait_s: float = 15.0
    targets: Mapping[str, float] = field(default_factory=lambda: dict(TARGETS))

    def smoke(self) -> PeersConfig:
        """A few seconds per stack and condition: the harness works (figures not meaningful)."""
        return replace(self, connections=(16, 64), duration_s=2, warmup_s=1, reps=1, drain_s=4)


# -- CPU of process trees (pure parts tested) -------------------------------------------


def parse_stat(text: str) -> tuple[int, int, int]:
    """(parent pid, own CPU ticks, reaped children's CPU ticks) from /proc/<pid>/stat."""
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def tree_ticks(stats: Mapping[int, tuple[int, int, int]], roots: Sequence[int]) -> int:
    """CPU ticks of ``roots`` and all their descendants, plus what the roots reaped.

    A server process that exited between two readings (a PostgreSQL backend
    whose client hung up) is in its parent's reaped figure.
    """
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    seen: set[int] = set()
    todo = [r for r in roots if r in stats]
    total = sum(stats[r][2] for r in todo)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, []))
    return total


def _all_stats() -> dict[int, tuple[int, int, int]]:
    out: dict[int, tuple[int, int, int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[int(entry.name)] = parse_stat(Path(entry.path, "stat").read_text())
    return out


def _tree_cpu_s(roots: Sequence[int]) -> float:
    return tree_ticks(_all_stats(), roots) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class _Cpu:
    at: float
    machine_s: float
    stack_s: float
    sink_s: float
    children_s: float
    self_s: float


def _cpu(stack: Sequence[int], sink_pid: int) -> _Cpu:
    snap = cpu_snapshot(sink_pid)
    return _Cpu(
        snap.at,
        snap.machine_busy_s,
        _tree_cpu_s(stack),
        snap.process_s,
        snap.children_s,
        snap.self_s,
    )


def cpu_between(a: _Cpu, b: _Cpu) -> dict[str, float]:
    """Percent of one core: the stack, the SMTP sink, wrk, the bench, and everyone else."""
    wall = max(b.at - a.at, 1e-9)

    def pct(x: float, y: float) -> float:
        return round((y - x) / wall * 100, 1)

    out = {
        "stack_pct": pct(a.stack_s, b.stack_s),
        "sink_pct": pct(a.sink_s, b.sink_s),
        "wrk_pct": pct(a.children_s, b.children_s),
        "bench_pct": pct(a.self_s, b.self_s),
        "machine_pct": pct(a.machine_s, b.machine_s),
    }
    used = out["stack_pct"] + out["sink_pct"] + out["wrk_pct"] + out["bench_pct"]
    out["others_pct"] = round(max(0.0, out["machine_pct"] - used), 1)
    out["seconds"] = round(wall, 3)
    return out


# -- result shaping (pure) ----------------------------------------------------------------


def drain_rate(samples: Sequence[tuple[float, int]], backlog: int) -> float | None:
    """Emails/s between 10 % and 90 % of ``backlog`` delivered, from (time, delivered) samples.

    A drain cut before 90 % (the time limit) gives the rate from a tenth of
    what it delivered to its last sample, so start-up never counts. None below
    20 emails in that stretch, or without a time interval.
    """
    if backlog <= 0 or not samples:
        return None
    low = 0.1 * min(backlog, samples[-1][1])
    high = 0.9 * backlog
    start = next(((t, d) for t, d in samples if d >= low), None)
    end = next(((t, d) for t, d in samples if d >= high), samples[-1])
    if start is None or end[0] <= start[0] or end[1] - start[1] < 20:
        return None
    return (end[1] - start[1]) / (end[0] - start[0])


def peak(levels: Mapping[str, Mapping[str, Any]]) -> tuple[str, float] | None:
    """The connection count with the most req/s, and that rate."""
    best = max(levels.items(), key=lambda kv: kv[1]["rps"], default=None)
    return (best[0], float(best[1]["rps"])) if best else None


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """summary[stack][condition]: medians (min-max) over repetitions of each figure."""
    grouped: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in runs:
        grouped.setdefault((r["stack"], r["condition"]), []).append(r)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (stack, condition), rs in grouped.items():
        fig: dict[str, Any] = {}
        levels = sorted({c for r in rs for c in r["load"]["levels"]}, key=int)
        for c in levels:
            at = [r["load"]["levels"][c] for r in rs if c in r["load"]["levels"]]
            fig[f"rps@{c}"] = _spread([a["rps"] for a in at])
            fig[f"p50_ms@{c}"] = _spread([a["p50_ms"] for a in at])
            fig[f"p99_ms@{c}"] = _spread([a["p99_ms"] for a in at])
            fig[f"cpu_us_per_request@{c}"] = _spread([a.get("cpu_us_per_request") for a in at])
            fig[f"others_pct@{c}"] = _spread([a["cpu"]["others_pct"] for a in at])
            fig[f"errors@{c}"] = sum(a["errors"] for a in at)
        peaks = [p for r in rs if (p := peak(r["load"]["levels"]))]
        fig["peak_rps"] = _spread([p[1] for p in peaks])
        fig["peak_connections"] = [p[0] for p in peaks]
        fig["drain_emails_per_s"] = _spread([r["drain"].get("emails_per_s") for r in rs])
        fig["drain_cpu_us_per_email"] = _spread([r["drain"].get("cpu_us_per_email") for r in rs])
        fig["emails_per_s_while_loaded"] = _spread(
            [r["load"].get("emails_per_s_while_loaded") for r in rs]
        )
        fig["drain_complete"] = all(r["drain"].get("complete") for r in rs)
        out.setdefault(stack, {})[condition] = fig
    return out


def _spread(values: Sequence[float | None]) -> Spread | None:
    kept = [v for v in values if v is not None]
    return spread(kept) if kept else None


def _rps_at_reference(runs: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, int], float]:
    """req/s at REFERENCE connections by (stack, condition, repetition)."""
    rps: dict[tuple[str, str, int], float] = {}
    for r in runs:
        level = r["load"]["levels"].get(str(REFERENCE))
        if level and level.get("rps"):
            rps[(r["stack"], r["condition"], r["rep"])] = level["rps"]
    return rps


def _paired(
    rps: Mapping[tuple[str, str, int], float], over: tuple[str, str], under: tuple[str, str]
) -> Spread | None:
    """``over`` ÷ ``under`` ((stack, condition) each), paired per repetition."""
    values = [
        v / rps[(*under, rep)]
        for (stack, cond, rep), v in rps.items()
        if (stack, cond) == over and (*under, rep) in rps
    ]
    return spread(values) if values else None


def ratios(
    runs: Sequence[Mapping[str, Any]], pairs: Sequence[tuple[str, str]] = PAIRS
) -> dict[str, dict[str, Spread | None]]:
    """ratios["toko÷peer"][condition]: req/s at REFERENCE connections, paired per repetition."""
    rps = _rps_at_reference(runs)
    return {
        f"{toko}÷{peer}": {c: _paired(rps, (toko, c), (peer, c)) for c in CONDITIONS}
        for toko, peer in pairs
    }


def ceilings(
    runs: Sequence[Mapping[str, Any]], peers: Sequence[str] = PEERS
) -> dict[str, dict[str, Spread | None]]:
    """ceilings["memory÷peer"][condition]: the in-memory handler's req/s (parked: it has
    no jobs) over the peer's under each condition, at REFERENCE connections, paired per
    repetition. A toko ÷ peer target above it asks toko to beat a server that stores
    nothing."""
    rps = _rps_at_reference(runs)
    if not any(stack == MEMORY for stack, _, _ in rps):
        return {}
    return {
        f"{MEMORY}÷{peer}": {c: _paired(rps, (MEMORY, "parked"), (peer, c)) for c in CONDITIONS}
        for peer in peers
    }


def verdicts(
    ratio_table: Mapping[str, Mapping[str, Spread | None]], targets: Mapping[str, float]
) -> list[dict[str, Any]]:
    """One pass/fail line per pair and condition: the median ratio against its target."""
    out = []
    for pair, by_condition in ratio_table.items():
        for condition, s in by_condition.items():
            if condition not in targets:
                continue
            median = s["median"] if s else None
            out.append(
                {
                    "pair": pair,
                    "condition": condition,
                    "ratio": median,
                    "target": targets[condition],
                    "met": median is not None and median >= targets[condition],
                }
            )
    return out


def pair_name(pair: str) -> str:
    toko, peer = pair.split("÷")
    return f"{NAMES.get(toko, toko)} ÷ {NAMES.get(peer, peer)}"


def _fmt(s: Spread | None, fmt: str = "{:.0f}", unit: str = "") -> str:
    return fmt_spread(s, fmt, unit) if s else "n/a"


def _ran_as(stack: str, condition: str) -> str:
    return "no jobs" if stack == MEMORY else CONDITION_NAMES[condition]


def _ceiling_rows(result: Mapping[str, Any]) -> list[tuple[str, str, Spread | None, float]]:
    """(what, condition's name, ratio, the toko ÷ peer target it bounds) per ceiling."""
    out = []
    for pair, by_condition in result.get("ceilings", {}).items():
        for condition, s in by_condition.items():
            name = f"{CONDITION_NUMBERS[condition]} {CONDITION_NAMES[condition]}"
            peer = NAMES.get(pair.split("÷")[1], pair)
            out.append((f"in-memory handler ÷ {peer}", name, s, result["targets"][condition]))
    return out


def report_rows(result: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows for bench.report: (scenario, measure, value, target)."""
    c = result["config"]
    out: list[tuple[str, str, str, str]] = []
    for stack, by_condition in result["summary"].items():
        for condition, f in by_condition.items():
            out.append(
                (
                    f"(i) {NAMES.get(stack, stack)}, {_ran_as(stack, condition)}",
                    f"req/s at 16 · 64 · peak; p50 · p99 · CPU/request at 16; drain emails/s"
                    f" ({c['duration_s']:g} s per level, {c['reps']} reps)",
                    f"{_fmt(f.get('rps@16'))} · {_fmt(f.get('rps@64'))} ·"
                    f" {_fmt(f.get('peak_rps'))} (at {'/'.join(f['peak_connections'])});"
                    f" {_fmt(f.get('p50_ms@16'), '{:.2f}', ' ms')} ·"
                    f" {_fmt(f.get('p99_ms@16'), '{:.2f}', ' ms')} ·"
                    f" {_fmt(f.get('cpu_us_per_request@16'), '{:.0f}', ' µs')};"
                    f" {_fmt(f.get('drain_emails_per_s'))}",
                    "",
                )
            )
    for v in result["verdicts"]:
        ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}"
        spread_ = result["ratios"][v["pair"]][v["condition"]]
        out.append(
            (
                f"(i) {pair_name(v['pair'])}, {CONDITION_NAMES[v['condition']]}",
                f"req/s ratio at {REFERENCE} connections, condition"
                f" {CONDITION_NUMBERS[v['condition']]}, paired per repetition",
                _fmt(spread_, "{:.2f}") if spread_ else ratio,
                f"≥ {v['target']:g} {'✅ met' if v['met'] else '❌ missed'}",
            )
        )
    for pair, condition, s, target in _ceiling_rows(result):
        out.append(
            (
                f"(i) {pair}, the peer's {condition}",
                f"req/s ratio at {REFERENCE} connections: the most one Python process answers"
                " here (not counted)",
                _fmt(s, "{:.2f}"),
                f"beside toko's target ≥ {target:g}",
            )
        )
    return out


def markdown(result: Mapping[str, Any]) -> list[str]:
    c = result["config"]
    levels = c["connections"]
    out = [
        f"**(i) Peer stacks doing toko's job**: wrk POST /produk at {', '.join(map(str, levels))}"
        f" connections, {c['duration_s']:g} s each after a {c['warmup_s']:g} s warm-up;"
        f" {c['workers']} job workers per stack; drain through {c['smtp']}, at most"
        f" {c['drain_s']:g} s; median of {c['reps']} alternating repetitions (min-max).",
        "",
        "| Stack | job workers | req/s @16 | req/s @64 | peak (conns) | p50 @16 | p99 @16 |"
        " CPU/request @16 | others @16 | emails/s while loaded | drain emails/s | CPU/email |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stack, by_condition in result["summary"].items():
        for condition, f in by_condition.items():
            loaded = _fmt(f.get("emails_per_s_while_loaded")) if condition == "running" else "none"
            ran_as = "none" if stack == MEMORY else f"{CONDITION_NUMBERS[condition]} {condition}"
            out.append(
                f"| {NAMES.get(stack, stack)} | {ran_as}"
                f" | {_fmt(f.get('rps@16'))}"
                f" | {_fmt(f.get('rps@64'))} | {_fmt(f.get('peak_rps'))}"
                f" ({'/'.join(f['peak_connections'])})"
                f" | {_fmt(f.get('p50_ms@16'), '{:.2f}', ' ms')}"
                f" | {_fmt(f.get('p99_ms@16'), '{:.2f}', ' ms')}"
                f" | {_fmt(f.get('cpu_us_per_request@16'), '{:.0f}', ' µs')}"
                f" | {_fmt(f.get('others_pct@16'), '{:.0f}', ' %')} | {loaded}"
                f" | {_fmt(f.get('drain_emails_per_s'))}"
                f" | {_fmt(f.get('drain_cpu_us_per_email'), '{:.0f}', ' µs')} |"
            )
    out += ["", "| toko ÷ peer, req/s at 16 connections | ratio | target |", "|---|---:|---|"]
    for v in result["verdicts"]:
        s = result["ratios"][v["pair"]][v["condition"]]
        out.append(
            f"| {pair_name(v['pair'])}, {CONDITION_NUMBERS[v['condition']]}"
            f" {CONDITION_NAMES[v['condition']]} | {_fmt(s, '{:.2f}')}"
            f" | ≥ {v['target']:g} {'✅ met' if v['met'] else '❌ missed'} |"
        )
    ceiling_rows = _ceiling_rows(result)
    if ceiling_rows:
        out += [
            "",
            "| in-memory handler ÷ peer, req/s at 16 connections (not counted) | ratio"
            " | toko's target |",
            "|---|---:|---:|",
        ]
        out += [
            f"| {p}, the peer's {c} | {_fmt(s, '{:.2f}')} | ≥ {t:g} |"
            for p, c, s, t in ceiling_rows
        ]
    out += ["", "Set-ups, where they differ from each project's documentation:", ""]
    out += [f"- {NAMES[s]}: {d}." for s, d in result["differences"].items()]
    return [*out, ""]


# -- running --------------------------------------------------------------------------------


@dataclass
class _Env:
    cfg: PeersConfig
    workdir: Path
    cluster: Any = None
    redis: RedisServer | None = None
    postmaster: int | None = None
    dropped: list[Callable[[], None]] = field(default_factory=list)

    def database(self, prefix: str) -> str:
        url: str = self.cluster.create_database(prefix)
        self.dropped.append(lambda: asyncio.run(self.cluster.async_drop_database(url)))
        return url

    def drop_all(self) -> None:
        while self.dropped:
            with contextlib.suppress(Exception):
                self.dropped.pop()()


@dataclass
class _Stack:
    """A stack's running web server, where it listens, and the pids whose CPU is its own."""

    base_url: str
    pids: list[int]
    start_workers: Callable[[], contextlib.AbstractContextManager[list[int]]] | None = None


def _peer_env(smtp_url: str, **extra: str) -> dict[str, str]:
    return base_env(PEER_SMTP_URL=smtp_url, **extra)


@contextlib.contextmanager
def _worker_proc(name: str, cmd: list[str], penv: dict[str, str], log: Path) -> Iterator[list[int]]:
    with managed(name, cmd, log_path=log, env=penv) as proc:
        time.sleep(0.5)  # connected and listening (neither CLI says when)
        proc.check_alive()
        yield [proc.pid]


@contextlib.contextmanager
def _fastapi(env: _Env, name: str, smtp_url: str) -> Iterator[_Stack]:
    cfg = env.cfg
    url = env.database("peer")
    penv = _peer_env(
        smtp_url,
        PEER_DATABASE_URL=url,
        PEER_DATABASE_PASSWORD_FILE=str(env.cluster.password_file),
        PEER_POOL_SIZE=str(cfg.pool_size),
        PEER_WORKER_POOL_SIZE=str(cfg.workers + 2),
    )
    setup = subprocess.run(
        [sys.executable, "-m", "bench.peer_fastapi", "setup"],
        env=penv,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if setup.returncode != 0:
        raise RuntimeError(f"peer_fastapi setup failed: {setup.stderr[-1500:]}")
    port = free_port()
    web = [sys.executable, "-m", "uvicorn", "bench.peer_fastapi:api", "--host", "127.0.0.1"]
    web += ["--port", str(port), "--workers", str(cfg.web_workers)]
    web += ["--no-access-log", "--log-level", "warning"]
    # ``python -m``: the console scripts would not find the bench package.
    worker = [sys.executable, "-m", "procrastinate", "--app", "bench.peer_fastapi.jobs"]
    worker += ["--log-level", "warning", "worker", "--concurrency", str(cfg.workers)]
    target = Target("uvicorn", web, penv, port)
    with running(target, env.workdir / f"{name}-web.log") as proc:
        yield _Stack(
            target.base_url,
            [proc.pid, env.postmaster or 0],
            lambda: _worker_proc("procrastinate", worker, penv, env.workdir / f"{name}-worker.log"),
        )


@contextlib.contextmanager
def _aiohttp_arq(env: _Env, name: str, smtp_url: str) -> Iterator[_Stack]:
    assert env.redis is not None
    flush_redis(env.redis.port)
    port = free_port()
    penv = _peer_env(
        smtp_url,
        PEER_LISTEN_PORT=str(port),
        PEER_SQLITE=str(env.workdir / f"{name}.db"),
        PEER_REDIS_PORT=str(env.redis.port),
        PEER_MAX_JOBS=str(env.cfg.workers),
    )
    worker = [sys.executable, "-m", "arq", "bench.peer_arq.WorkerSettings"]
    worker += ["--custom-log-dict", "bench.peer_arq.LOG_WARNING"]
    target = Target("aiohttp", [sys.executable, "-m", "bench.peer_arq"], penv, port)
    with running(target, env.workdir / f"{name}-web.log") as proc:
        yield _Stack(
            target.base_url,
            [proc.pid, env.redis.proc.pid],
            lambda: _worker_proc("arq", worker, penv, env.workdir / f"{name}-worker.log"),
        )


def _durable_redis(port: int) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        client.config_set("appendfsync", "everysec")
        client.config_set("appendonly", "yes")
    finally:
        client.close()


def _toko_target(env: _Env, database: str, smtp_url: str, workers: int, **extra: str) -> Target:
    extra_env = dict(extra)
    if database.startswith("postgresql://"):
        extra_env["TOKO_DATABASE_PASSWORD_FILE"] = str(env.cluster.password_file)
    target = toko_target(
        env.cfg.toko,
        Path(database),
        workers=workers,
        smtp_url=smtp_url,
        log_level="warning",
        extra_env=extra_env,
    )
    target.env["TOKO_DATABASE"] = database  # a URL is not a Path
    return target


def _toko_database(env: _Env, stack: str, name: str) -> str:
    return env.database("toko") if stack == TOKO_PG else str(env.workdir / f"{name}.db")


def _toko_pids(env: _Env, stack: str, pid: int) -> list[int]:
    return [pid, env.postmaster or 0] if stack == TOKO_PG else [pid]


def _load(
    env: _Env, stack: _Stack, sink: PostfixSink | None, sink_pid: int, name: str
) -> dict[str, Any]:
    cfg = env.cfg
    script = env.workdir / "post_produk.lua"
    log = env.workdir / "wrk.log"
    url = stack.base_url + "/produk"

    def wrk(connections: int, seconds: float, token: str) -> WrkResult:
        return run_wrk(
            url,
            script=script,
            duration_s=seconds,
            connections=connections,
            threads=cfg.threads,
            token=token,
            log=log,
        )

    delivered0 = sink.messages() if sink else 0
    t0 = time.monotonic()
    results = [wrk(REFERENCE, cfg.warmup_s, f"{name}-warm")]
    levels: dict[str, Any] = {}
    for c in cfg.connections:
        before = _cpu(stack.pids, sink_pid)
        res = wrk(c, cfg.duration_s, f"{name}-c{c}")
        cpu = cpu_between(before, _cpu(stack.pids, sink_pid))
        results.append(res)
        ok = res.requests - res.error_count
        levels[str(c)] = {
            "rps": res.rps,
            "p50_ms": res.latency_ms["p50"],
            "p99_ms": res.latency_ms["p99"],
            "errors": res.error_count,
            "requests": res.requests,
            "cpu": cpu,
            "cpu_us_per_request": (
                cpu["stack_pct"] / 100 * cpu["seconds"] / ok * 1e6 if ok > 0 else None
            ),
        }
    seconds = time.monotonic() - t0
    delivered = (sink.messages() if sink else 0) - delivered0
    return {
        "levels": levels,
        "acknowledged": sum(r.requests - r.error_count for r in results),
        "seconds": round(seconds, 2),
        "delivered_while_loaded": delivered,
        "emails_per_s_while_loaded": delivered / seconds if sink else None,
    }


def _drain(
    env: _Env, pids: list[int], sink: PostfixSink, backlog: int, started: int
) -> dict[str, Any]:
    """Poll the sink until ``backlog`` more emails arrived after ``started``, or drain_s."""
    samples: list[tuple[float, int]] = []
    before = _cpu(pids, sink.proc.pid)
    t0 = time.monotonic()
    while True:
        got = sink.messages() - started
        now = time.monotonic()
        samples.append((now, got))
        if got >= backlog or now - t0 > env.cfg.drain_s:
            break
        time.sleep(0.05)
    cpu = cpu_between(before, _cpu(pids, sink.proc.pid))
    delivered = samples[-1][1]
    return {
        "backlog": backlog,
        "delivered": delivered,
        "complete": delivered >= backlog,
        "seconds": round(samples[-1][0] - t0, 2),
        "emails_per_s": drain_rate(samples, backlog),
        "cpu": cpu,
        "cpu_us_per_email": (
            cpu["stack_pct"] / 100 * cpu["seconds"] / delivered * 1e6 if delivered else None
        ),
    }


def _run_toko(env: _Env, stack_name: str, condition: str, name: str) -> dict[str, Any]:
    cfg, workdir = env.cfg, env.workdir
    database = _toko_database(env, stack_name, name)
    with postfix_sink(workdir, f"{name}-smtp") as sink:
        if condition == "running":
            target = _toko_target(env, database, sink.url, cfg.workers)
            with running(target, workdir / f"{name}.log") as proc:
                stack = _Stack(target.base_url, _toko_pids(env, stack_name, proc.pid))
                load = _load(env, stack, sink, sink.proc.pid, name)
                done = sink.messages()
                backlog = max(0, load["acknowledged"] - done)
                drain = _drain(env, stack.pids, sink, backlog, done)
            return {"load": load, "drain": drain}
        # Parked: one worker, held by an SMTP server that never answers in time.
        hang_record = workdir / f"{name}-hang.tsv"
        with smtp_sink(workdir, f"{name}-hang", 3600.0, hang_record) as hang:
            held = {"TOKO_DRAIN_TIMEOUT": "1", "TOKO_JOB_TIMEOUT": "3600"}
            target = _toko_target(env, database, hang.url, 1, **held)
            with running(target, workdir / f"{name}-parked.log") as proc:
                stack = _Stack(target.base_url, _toko_pids(env, stack_name, proc.pid))
                load = _load(env, stack, None, sink.proc.pid, name)
                hang.proc.stop()  # first, so toko-api's stop is not held up by it
        target = _toko_target(env, database, sink.url, cfg.workers)
        started = sink.messages()
        with running(target, workdir / f"{name}-drain.log") as proc:
            pids = _toko_pids(env, stack_name, proc.pid)
            drain = _drain(env, pids, sink, load["acknowledged"], started)
    return {"load": load, "drain": drain}


def _run_peer(env: _Env, stack_name: str, condition: str, name: str) -> dict[str, Any]:
    start = _fastapi if stack_name == FASTAPI else _aiohttp_arq
    with postfix_sink(env.workdir, f"{name}-smtp") as sink, start(env, name, sink.url) as stack:
        assert stack.start_workers is not None
        with contextlib.ExitStack() as workers:
            if condition == "running":
                pids = stack.pids + workers.enter_context(stack.start_workers())
                load = _load(env, replace(stack, pids=pids), sink, sink.proc.pid, name)
                done = sink.messages()
                backlog = max(0, load["acknowledged"] - done)
                return {"load": load, "drain": _drain(env, pids, sink, backlog, done)}
            load = _load(env, stack, sink, sink.proc.pid, name)
            started = sink.messages()
            pids = stack.pids + workers.enter_context(stack.start_workers())
            return {"load": load, "drain": _drain(env, pids, sink, load["acknowledged"], started)}


def _run_memory(env: _Env, stack_name: str, condition: str, name: str) -> dict[str, Any]:
    target = baseline_target()
    # The same idle sink as beside every stack, so that "others" means the same.
    with (
        postfix_sink(env.workdir, f"{name}-smtp") as sink,
        running(target, env.workdir / f"{name}.log") as proc,
    ):
        load = _load(env, _Stack(target.base_url, [proc.pid]), None, sink.proc.pid, name)
    nothing = {"backlog": 0, "delivered": 0, "complete": True, "emails_per_s": None}
    return {"load": load, "drain": nothing}


_RUNS = {TOKO_PG: _run_toko, TOKO_SQLITE: _run_toko, MEMORY: _run_memory}


def _print(run: Mapping[str, Any]) -> None:
    levels = run["load"]["levels"]
    rates = "  ".join(f"@{c} {v['rps']:6.0f}" for c, v in levels.items())
    ref = levels.get(str(REFERENCE), {})
    cpu = ref.get("cpu_us_per_request")
    others = ref.get("cpu", {}).get("others_pct", 0)
    d = run["drain"]
    print(
        f"  rep {run['rep']} {run['stack']:13s} {run['condition']:7s} req/s {rates}"
        f"  CPU/req@{REFERENCE} {cpu or 0:.0f} µs  others {others:.0f} %"
        f"  drain {d['emails_per_s'] or 0:.0f}/s ({d['delivered']}/{d['backlog']})",
        flush=True,
    )


@contextlib.contextmanager
def _servers(cfg: PeersConfig, workdir: Path) -> Iterator[_Env]:
    env = _Env(cfg, workdir)
    with contextlib.ExitStack() as stack:
        if any(s in (TOKO_PG, FASTAPI) for s in cfg.stacks):
            from tests.support.postgres import acquire_cluster, release_cluster

            env.cluster = acquire_cluster()
            stack.callback(release_cluster)
            pid_file = env.cluster.datadir / "postmaster.pid"
            env.postmaster = int(pid_file.read_text().split()[0])
        if ARQ in cfg.stacks:
            env.redis = stack.enter_context(redis_server(workdir / "redis.log"))
            _durable_redis(env.redis.port)
        stack.callback(env.drop_all)
        yield env


def order(stacks: Sequence[str], conditions: Sequence[str], rep: int) -> list[tuple[str, str]]:
    """The (stack, condition) runs of one repetition: stacks rotated by ``rep``, conditions
    alternating, so neither a stack nor a condition always goes first."""
    k = rep % len(stacks) if stacks else 0
    rotated = [*stacks[k:], *stacks[:k]]
    conds = list(conditions) if rep % 2 == 0 else list(reversed(conditions))
    # The in-memory handler has no workers to run: parked is its only condition.
    return [(s, c) for c in conds for s in rotated if s != MEMORY or c == "parked"]


def run(cfg: PeersConfig, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "post_produk.lua").write_text(POST_PRODUK_LUA)
    if not shutil.which("wrk"):
        raise RuntimeError("wrk not found (apt-get install wrk; make bench does it)")
    runs: list[dict[str, Any]] = []
    with _servers(cfg, workdir) as env:
        for rep in range(cfg.reps):
            for stack_name, condition in order(cfg.stacks, cfg.conditions, rep):
                name = f"r{rep + 1}-{stack_name}-{condition}"
                quiet = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
                go = _RUNS.get(stack_name, _run_peer)
                result = go(env, stack_name, condition, name)
                entry = {"stack": stack_name, "condition": condition, "rep": rep + 1, **result}
                entry["before"] = quiet
                runs.append(entry)
                _print(entry)
                env.drop_all()
    return shape(cfg, runs)


PEER_PACKAGES = ("fastapi", "uvicorn", "uvloop", "httptools", "procrastinate", "psycopg", "arq")
PEER_PACKAGES += ("aiosqlite", "aiohttp", "aiosmtplib")


def versions(packages: Sequence[str] = PEER_PACKAGES) -> dict[str, str]:
    """Installed versions, read from the packages' metadata (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in packages:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    redis = shutil.which("redis-server")
    if redis:
        probe = subprocess.run([redis, "--version"], capture_output=True, text=True, timeout=10)
        out["redis-server"] = probe.stdout.strip()
    return out


def shape(cfg: PeersConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ratio_table = ratios(runs, [p for p in PAIRS if set(p) <= set(cfg.stacks)])
    peers = [p for p in PEERS if p in cfg.stacks]
    lines = verdicts(ratio_table, cfg.targets)
    return {
        "config": {
            "connections": list(cfg.connections),
            "duration_s": cfg.duration_s,
            "warmup_s": cfg.warmup_s,
            "reps": cfg.reps,
            "workers": cfg.workers,
            "web_workers": cfg.web_workers,
            "pool_size": cfg.pool_size,
            "drain_s": cfg.drain_s,
            "stacks": list(cfg.stacks),
            "smtp": "Postfix's smtp-sink (bench.postfix)",
            "postgres": "throwaway cluster 127.0.0.1, fsync=on, synchronous_commit=on",
            "redis": "redis-server 127.0.0.1, appendonly yes, appendfsync everysec",
            "versions": versions(),
        },
        "summary": summarize(runs),
        "ratios": ratio_table,
        "ceilings": ceilings(runs, peers),
        "verdicts": lines,
        "targets": dict(cfg.targets),
        "met": bool(lines) and all(v["met"] for v in lines),
        "differences": {s: DIFFERENCES[s] for s in cfg.stacks},
        "runs": runs,
    }
