"""(c) Start-to-READY time and idle RSS of toko-api.

Each start uses a fresh SQLite file (so schema migrations are included) and
a real AF_UNIX datagram socket as NOTIFY_SOCKET. The clock runs from just
before spawning the process to the arrival of the datagram holding
``READY=1``. RSS is VmRSS from /proc/<pid>/status after a short idle period.

Measured for each install given: toko-api as the Debian package installs it
(bench.deployed), which the targets are for, and the developers' venv.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.procs import NotifySocket, managed, port_accepts, rss_kib
from bench.stats import spread
from bench.toko import TokoCommand, toko_target


@dataclass(frozen=True)
class StartupConfig:
    toko: TokoCommand
    starts: int = 5
    idle_s: float = 2.0
    ready_timeout_s: float = 30.0


# Issue 34's lines, for toko-api as the package installs it.
READY_TARGET_MS = 300.0
RSS_TARGET_MIB = 40.0


def run_installs(
    cfg: StartupConfig,
    installs: list[tuple[str, TokoCommand]],
    workdir: Path,
    targeted: bool = True,
) -> dict[str, Any]:
    """``run`` for each (label, toko-api) in turn; the first is held to the targets
    when ``targeted``."""
    measured = []
    for i, (label, toko) in enumerate(installs):
        print(f"  {label}: {' '.join(toko.argv)}", flush=True)
        one = run(replace(cfg, toko=toko), workdir / f"install-{i + 1}")
        measured.append({"label": label, "revision": toko.revision, **one})
    out = {k: v for k, v in measured[0].items() if k in ("config", "starts", "summary")}
    out["installs"] = measured
    if targeted:
        targets = {"ready_ms": READY_TARGET_MS, "rss_mib": RSS_TARGET_MIB}
        first = measured[0]["summary"]
        out["targets"] = targets
        out["checks"] = {k: first[k]["median"] <= limit for k, limit in targets.items()}
        out["met"] = all(out["checks"].values())
    return out


def run(cfg: StartupConfig, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    starts: list[dict[str, Any]] = []
    # AF_UNIX paths are limited to 107 bytes: keep the socket in a short temp dir.
    with tempfile.TemporaryDirectory(prefix="toko-bench-") as sockdir:
        for i in range(cfg.starts):
            db = workdir / f"start-{i + 1}.db"
            sock_path = Path(sockdir) / f"notify-{i + 1}.sock"
            with NotifySocket(sock_path) as ns:
                target = toko_target(cfg.toko, db, notify_socket=sock_path)
                t0 = time.monotonic()
                with managed(
                    "toko-api",
                    target.cmd,
                    log_path=workdir / f"start-{i + 1}.log",
                    env=target.env,
                    cwd=target.cwd,
                ) as proc:
                    t_ready = ns.wait_for("READY=1", cfg.ready_timeout_s, proc)
                    accepting = port_accepts(target.port)
                    time.sleep(cfg.idle_s)
                    proc.check_alive()
                    mem = rss_kib(proc.pid)
                    t_stop = time.monotonic()
                    rc = proc.stop()
                    stop_s = time.monotonic() - t_stop
            ready_ms = (t_ready - t0) * 1000.0
            rss = mem.get("VmRSS", 0)
            entry: dict[str, Any] = {
                "ready_ms": ready_ms,
                "port_accepting_at_ready": accepting,
                "rss_kib": rss,
                "hwm_kib": mem.get("VmHWM"),
                "threads": mem.get("Threads"),
                "stop_ms": stop_s * 1000.0,
                "exit_code": rc,
                "notify": [m for _, m in ns.messages],
            }
            starts.append(entry)
            print(
                f"  start {i + 1}: READY after {ready_ms:.0f} ms, "
                f"RSS {rss / 1024:.1f} MiB, stop {stop_s * 1000:.0f} ms, "
                f"exit {rc}",
                flush=True,
            )
    return {
        "config": {"starts": cfg.starts, "idle_s": cfg.idle_s},
        "starts": starts,
        "summary": {
            "ready_ms": spread([s["ready_ms"] for s in starts]),
            "rss_mib": spread([s["rss_kib"] / 1024 for s in starts]),
            "hwm_mib": spread([s["hwm_kib"] / 1024 for s in starts]),
            "stop_ms": spread([s["stop_ms"] for s in starts]),
            "all_ready_with_port_open": all(s["port_accepting_at_ready"] for s in starts),
            "all_exit_0": all(s["exit_code"] == 0 for s in starts),
        },
    }
