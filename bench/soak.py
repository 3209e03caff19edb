"""A soak for leaks: toko-api under a mixed, changing load for minutes, measured from outside.

Opt-in, not part of ``make test`` or ``python -m bench``'s default scenarios::

    python -m bench.soak                      # SQLite, 5 rounds of 5 phases of 20 s
    python -m bench.soak --backend postgres   # a throwaway PostgreSQL cluster
    python -m bench.soak --rounds 3 --phase 10

Each phase keeps steady POSTs going (wrk, paced to a few hundred per second)
beside GET pages, /healthz, /metrics, the bad-input table of the integration
tests, clients that connect and send nothing or hang up mid-body, and repeated
Idempotency-Keys; a SIGUSR1 (fault injection: one worker killed, replaced)
lands in each phase. What changes from phase to phase is the SMTP server:
fast, slow (2 s per email), deferring (451), refusing (550), dropping its
connections. After the last round the server turns fast again and the backlog
drains. VmRSS, open descriptors (by kind) and threads of the toko-api process
are read from /proc at the start and end of every phase, after the drain and
after a short idle. A leak is growth from round 2 to the last round that the
drain does not give back; round 1 fills allocator high-water marks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import REPO, Managed, rss_kib, venv_bin
from bench.toko import TokoCommand, get_json, running, toko_target
from tests.support import http
from tests.support.smtp import SmtpServer

PACED_POST_LUA = r"""
local counter = 0
local prefix = "soak"
function init(args)
   prefix = "soak-" .. (args[1] or "run") .. "-" .. tostring(math.random(1e9))
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
end
function delay() return %(delay_ms)d end
function request()
   counter = counter + 1
   return wrk.format(nil, nil, nil,
      string.format('{"nama": "%%s-%%d", "harga": %%d}', prefix, counter, counter))
end
"""


def fd_kinds(pid: int) -> Counter[str]:
    """Open descriptors of ``pid`` by kind: socket, pipe, anon_inode:..., or a file's path."""
    kinds: Counter[str] = Counter()
    fd_dir = Path(f"/proc/{pid}/fd")
    for entry in fd_dir.iterdir():
        try:
            target = os.readlink(entry)
        except FileNotFoundError:
            continue
        kind = target.split(":[", 1)[0] if ":[" in target else target
        kinds[kind] += 1
    return kinds


def sample(pid: int, base_url: str) -> dict[str, Any]:
    status = rss_kib(pid)
    kinds = fd_kinds(pid)
    out: dict[str, Any] = {
        "rss_kib": status["VmRSS"],
        "hwm_kib": status["VmHWM"],
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "fds": sum(kinds.values()),
        "fd_kinds": dict(kinds),
    }
    with contextlib.suppress(OSError, ValueError):
        code, health = get_json(base_url + "/healthz", timeout=10)
        if isinstance(health, dict):
            out["health"] = code
            out["queue"] = health.get("queue")
            out["workers"] = health.get("workers")
    return out


# -- SMTP behaviours -----------------------------------------------------------


def smtp_modes(server: SmtpServer) -> dict[str, Callable[[], None]]:
    def fast() -> None:
        server.reset()

    def slow() -> None:
        server.reset()
        server.set_delay(2.0)

    def deferring() -> None:
        server.reset()
        server.fail_for(3600)

    def refusing() -> None:
        server.reset()
        server.refuse_subject("Produk baru")

    def dropping() -> None:  # dropped connections come from the phase loop
        server.reset()

    return {
        "fast": fast,
        "slow": slow,
        "deferring": deferring,
        "refusing": refusing,
        "dropping": dropping,
    }


# -- side traffic ----------------------------------------------------------------


def bad_cases() -> list[Any]:
    from tests.integration.test_bad_input import CASES

    return list(CASES)


async def _quietly(coro: Any) -> None:
    with contextlib.suppress(OSError, TimeoutError, ValueError, aiohttp.ClientError):
        await coro


async def _bad_input(port: int, case: Any) -> None:
    await http.request(
        port,
        case.method,
        case.path,
        body=case.body,
        headers=[*case.headers.items(), *case.repeated],
        chunked=case.chunked,
    )


async def _silent_client(port: int, hold: float) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await asyncio.sleep(hold)
    finally:
        writer.close()


async def _hang_up_mid_body(port: int) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        "POST /produk HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 400\r\n\r\n"
    )
    writer.write(head.encode() + b'{"nama": "Kop')
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.transport.abort()


async def side_traffic(base_url: str, port: int, stop: asyncio.Event, counts: Counter[str]) -> None:
    cases = bad_cases()
    keys = [f"soak-key-{i}" for i in range(40)]
    rnd = random.Random(7)
    background: set[asyncio.Task[None]] = set()

    def spawn(coro: Any) -> None:
        task = asyncio.create_task(_quietly(coro))
        background.add(task)
        task.add_done_callback(background.discard)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:

        async def get(path: str) -> None:
            async with session.get(base_url + path) as resp:
                await resp.read()
                counts[f"GET {path.split('?')[0]} {resp.status}"] += 1

        async def idempotent(key: str, harga: int) -> None:
            body = {"nama": f"idem {key}", "harga": harga}
            async with session.post(
                base_url + "/produk", json=body, headers={"Idempotency-Key": key}
            ) as resp:
                await resp.read()
                counts[f"POST idem {resp.status}"] += 1

        tick = 0
        while not stop.is_set():
            tick += 1
            spawn(get(f"/produk?after={rnd.randrange(0, 5000)}&limit={rnd.choice((1, 50, 200))}"))
            if tick % 5 == 0:
                spawn(get("/healthz"))
            if tick % 10 == 0:
                spawn(get("/metrics"))
            spawn(_bad_input(port, cases[tick % len(cases)]))
            key = rnd.choice(keys)
            spawn(idempotent(key, 1))
            if tick % 7 == 0:
                spawn(idempotent(key, 2))  # same key, other product: 422
            if tick % 4 == 0:
                spawn(_silent_client(port, hold=rnd.uniform(0.5, 20.0)))
            if tick % 3 == 0:
                spawn(_hang_up_mid_body(port))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)
        for task in list(background):
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)


# -- phases ---------------------------------------------------------------------


def start_wrk(url: str, script: Path, seconds: float, token: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["wrk", "-t1", "-c4", f"-d{int(seconds)}s", "-s", str(script), url, "--", token],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def run_phase(
    proc: Managed,
    base_url: str,
    port: int,
    server: SmtpServer,
    mode: str,
    seconds: float,
    script: Path,
    token: str,
    disrupt: Disrupt = None,
) -> dict[str, Any]:
    smtp_modes(server)[mode]()
    before = sample(proc.pid, base_url)
    wrk = start_wrk(base_url + "/produk", script, seconds, token)
    counts: Counter[str] = Counter()

    async def drive() -> None:
        stop = asyncio.Event()
        traffic = asyncio.create_task(side_traffic(base_url, port, stop, counts))
        t0 = time.monotonic()
        killed = cut = False
        while time.monotonic() - t0 < seconds:
            if mode == "dropping":
                await asyncio.to_thread(server.drop_connections)
            if not killed and time.monotonic() - t0 > seconds / 2:
                os.kill(proc.pid, signal.SIGUSR1)
                killed = True
            if disrupt is not None and not cut and time.monotonic() - t0 > seconds / 4:
                counts["db connections cut"] += await asyncio.to_thread(disrupt)
                cut = True
            await asyncio.sleep(0.5)
        stop.set()
        await traffic

    asyncio.run(drive())
    out, _ = wrk.communicate(timeout=seconds + 30)
    proc.check_alive()
    after = sample(proc.pid, base_url)
    text = out.decode(errors="replace")
    reqs = [line for line in text.splitlines() if "requests in" in line]
    return {
        "mode": mode,
        "start": before,
        "end": after,
        "wrk": reqs[0].strip() if reqs else text[-300:],
        "side": dict(counts),
    }


def drain(proc: Managed, base_url: str, server: SmtpServer, timeout: float) -> float:
    server.reset()
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        proc.check_alive()
        _, health = get_json(base_url + "/healthz", timeout=10)
        queue = health.get("queue", {}) if isinstance(health, dict) else {}
        if queue.get("pending", 1) == 0 and queue.get("running", 1) == 0:
            return time.monotonic() - t0
        time.sleep(1)
    return float("nan")


Disrupt = Callable[[], int] | None


@contextlib.contextmanager
def database(backend: str, workdir: Path) -> Iterator[tuple[str, dict[str, str], Disrupt]]:
    """The database, toko-api's environment for it, and (PostgreSQL) a way to cut
    every toko connection: the LISTEN connection and the lanes must come back."""
    if backend == "sqlite":
        yield str(workdir / "soak.db"), {}, None
        return
    from tests.support.postgres import PostgresCluster, fetch_sync

    cluster = PostgresCluster().start()
    try:
        url = cluster.create_database("soak")
        name = url.rsplit("/", 1)[1]

        def disrupt() -> int:
            rows = fetch_sync(
                cluster,
                cluster.url(),
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = $1 AND pid <> pg_backend_pid()",
                name,
            )
            return int(rows[0][0])

        yield url, {"TOKO_DATABASE_PASSWORD_FILE": str(cluster.password_file)}, disrupt
    finally:
        cluster.stop()


def row(label: str, s: dict[str, Any]) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["fd_kinds"].items()) if v)
    queue = s.get("queue") or {}
    return (
        f"{label:<24} rss {s['rss_kib'] / 1024:7.1f} MiB  fds {s['fds']:4d}  "
        f"threads {s['threads']:3d}  pending {queue.get('pending', '?'):>6}  "
        f"failed {queue.get('failed', '?'):>6}  [{kinds}]"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--phase", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--modes", default="fast,slow,deferring,refusing,dropping")
    p.add_argument("--post-delay-ms", type=int, default=10, help="wrk pause per connection")
    p.add_argument("--workers", type=int, default=8, help="TOKO_WORKERS (default 8)")
    p.add_argument("--idle", type=float, default=15.0, help="seconds idle after the drain")
    p.add_argument("--drain-timeout", type=float, default=300.0)
    p.add_argument(
        "--toko-cmd", default=None, help="command starting the service (default: toko-api)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the figures as JSON here (toko-api's log beside it, as .log; "
        "default log: bench/results/soak.log)",
    )
    args = p.parse_args(argv)
    if not shutil.which("wrk"):
        print("python -m bench.soak: wrk is not installed (apt install wrk)", file=sys.stderr)
        return 2
    modes = args.modes.split(",")
    toko = TokoCommand(shlex.split(args.toko_cmd) if args.toko_cmd else [str(venv_bin("toko-api"))])
    with (
        tempfile.TemporaryDirectory(prefix="toko-soak-") as tmp,
        SmtpServer() as server,
        database(args.backend, Path(tmp)) as (db, db_env, disrupt),
    ):
        workdir = Path(tmp)
        script = workdir / "post.lua"
        script.write_text(PACED_POST_LUA % {"delay_ms": args.post_delay_ms})
        target = toko_target(
            toko,
            Path(db),
            smtp_url=server.url,
            workers=args.workers,
            log_level="warning",
            extra_env={
                **db_env,
                "TOKO_FAULT_INJECTION": "1",
                "TOKO_JOB_BACKOFF": "0.5",
                "TOKO_JOB_MAX_ATTEMPTS": "3",
                "TOKO_CLIENT_TIMEOUT": "5",
            },
        )
        if db.startswith("postgresql://"):
            target.env["TOKO_DATABASE"] = db
        log_path = (args.out or REPO / "bench" / "results" / "soak.json").with_suffix(".log")
        results: dict[str, Any] = {"backend": args.backend, "phases": []}
        with running(target, log_path) as proc:
            first = sample(proc.pid, target.base_url)
            results["start"] = first
            print(row("start", first), flush=True)
            for r in range(1, args.rounds + 1):
                for mode in modes:
                    phase = run_phase(
                        proc,
                        target.base_url,
                        target.port,
                        server,
                        mode,
                        args.phase,
                        script,
                        f"r{r}{mode}",
                        disrupt,
                    )
                    phase["round"] = r
                    results["phases"].append(phase)
                    print(row(f"r{r} {mode} end", phase["end"]), "|", phase["wrk"], flush=True)
            drained = drain(proc, target.base_url, server, args.drain_timeout)
            results["drain_seconds"] = drained
            results["drained"] = sample(proc.pid, target.base_url)
            print(row(f"drained ({drained:.0f} s)", results["drained"]), flush=True)
            time.sleep(args.idle)
            results["idle"] = sample(proc.pid, target.base_url)
            print(row("idle", results["idle"]), flush=True)
            server.drop_connections()
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
