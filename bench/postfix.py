"""Postfix's ``smtp-sink`` and ``smtp-source`` for the bench, without installing Postfix.

``smtp-sink`` is Postfix's C test server: it takes SMTP messages and throws
them away, at a cost far below any Python server's, so an email-throughput
figure measured through it is the client's and not the sink's.
``smtp-source`` is its C counterpart, a parallel SMTP client, used here to
measure the sink's own ceiling on this machine (:func:`measure_ceiling`).

Installing the ``postfix`` package would configure and start a mail server
on the host. The bench needs neither, only these two programs, so
:func:`ensure_tools` fetches the Debian package with ``apt-get download``
and unpacks it with ``dpkg-deb -x`` into ``build/postfix/`` (gitignored);
they run from there with ``LD_LIBRARY_PATH`` set to the package's private
libraries. Nothing is installed and no maintainer script runs.

``python -m bench.postfix`` provisions them (idempotent; ``make bench`` runs
it) and prints their paths; ``python -m bench -s sink`` measures the ceiling.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import (
    REPO,
    Managed,
    base_env,
    cpu_snapshot,
    cpu_usage,
    free_port,
    managed,
    port_accepts,
    wait_for_quiet,
)
from bench.stats import Spread, fmt_spread, spread

CACHE = REPO / "build" / "postfix"
PACKAGE = "postfix"
_MARKER = ".toko-bench-extracted"
# smtp-sink -c writes "sess=N quit=N mesg=N" and a carriage return after each
# session end, QUIT and end of message; only a record with its \r is complete.
_COUNTER = re.compile(rb"sess=(\d+) quit=(\d+) mesg=(\d+)\r")


class ProvisionError(RuntimeError):
    """The Postfix package could not be fetched or unpacked."""


@dataclass(frozen=True)
class PostfixTools:
    """The unpacked package: where the programs, their libraries and man pages are."""

    root: Path
    version: str

    @property
    def sink(self) -> Path:
        return self.root / "usr" / "sbin" / "smtp-sink"

    @property
    def source(self) -> Path:
        return self.root / "usr" / "sbin" / "smtp-source"

    @property
    def libdir(self) -> Path:
        return self.root / "usr" / "lib" / "postfix"

    @property
    def man_dir(self) -> Path:
        return self.root / "usr" / "share" / "man"

    def env(self) -> dict[str, str]:
        """The bench's environment plus the package's private libraries."""
        env = base_env()
        env["LD_LIBRARY_PATH"] = ":".join(
            p for p in (str(self.libdir), env.get("LD_LIBRARY_PATH", "")) if p
        )
        return env


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def _apt_update() -> None:
    if os.geteuid() == 0:
        cmd = ["apt-get", "update", "-qq"]
    elif shutil.which("sudo"):
        cmd = ["sudo", "apt-get", "update", "-qq"]
    else:
        raise ProvisionError(
            f"apt-get download {PACKAGE} failed and updating the package lists needs root"
        )
    print("bench: apt-get update (to fetch the postfix package)", file=sys.stderr)
    proc = _run(cmd)
    if proc.returncode != 0:
        raise ProvisionError(f"apt-get update failed: {proc.stderr.strip()[-500:]}")


def _download(debs: Path) -> Path:
    """The package's .deb in ``debs``, fetched unless one is there already."""
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{PACKAGE}_*.deb"))
    if found:
        return found[-1]
    for attempt in range(2):
        # A fresh machine may have no package lists yet: update once, retry.
        proc = _run(["apt-get", "download", PACKAGE], cwd=debs)
        found = sorted(debs.glob(f"{PACKAGE}_*.deb"))
        if proc.returncode == 0 and found:
            return found[-1]
        if attempt == 0:
            _apt_update()
    raise ProvisionError(f"apt-get download {PACKAGE} failed: {proc.stderr.strip()[-500:]}")


def _works(tools: PostfixTools) -> bool:
    """Whether smtp-sink starts (it prints its usage without arguments: its libraries load).

    Only after unpacking: its exit on that usage error takes a second.
    """
    try:
        proc = subprocess.run(
            [str(tools.sink)], env=tools.env(), capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "usage" in proc.stderr


def ensure_tools(cache: Path = CACHE) -> PostfixTools:
    """Fetch and unpack the Postfix package into ``cache`` unless done already; the paths.

    Idempotent and safe to call from several processes at once (a file lock);
    once unpacked it needs no network.
    """
    cache.mkdir(parents=True, exist_ok=True)
    tree = cache / "tree"
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = tree / _MARKER
        if marker.is_file():
            tools = PostfixTools(tree, marker.read_text().strip())
            if tools.sink.is_file() and tools.source.is_file():
                return tools
        deb = _download(cache / "debs")
        version = _run(["dpkg-deb", "-f", str(deb), "Version"]).stdout.strip() or "unknown"
        staging = cache / "tree.new"
        shutil.rmtree(staging, ignore_errors=True)
        proc = _run(["dpkg-deb", "-x", str(deb), str(staging)])
        if proc.returncode != 0:
            raise ProvisionError(f"dpkg-deb -x {deb.name} failed: {proc.stderr.strip()[-500:]}")
        (staging / _MARKER).write_text(version + "\n")
        shutil.rmtree(tree, ignore_errors=True)
        staging.rename(tree)
        tools = PostfixTools(tree, version)
        if not _works(tools):
            raise ProvisionError(f"{tools.sink} does not start; see {tools.libdir}")
        return tools


@dataclass(frozen=True)
class SinkCounts:
    """smtp-sink's running counters (``-c``): sessions ended, QUITs, messages taken."""

    sessions: int
    quits: int
    messages: int


def read_counts(log: Path) -> SinkCounts:
    """The last complete counter record smtp-sink wrote to ``log`` (zeros before the first)."""
    try:
        with log.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            tail = f.read()
    except FileNotFoundError:
        tail = b""
    records = _COUNTER.findall(tail)
    if not records:
        return SinkCounts(0, 0, 0)
    sessions, quits, messages = (int(v) for v in records[-1])
    return SinkCounts(sessions, quits, messages)


@dataclass(frozen=True)
class PostfixSink:
    """A running smtp-sink. ``sessions`` counts the bench's readiness probe too."""

    port: int
    proc: Managed
    tools: PostfixTools

    @property
    def url(self) -> str:
        """The value for TOKO_SMTP_URL."""
        return f"smtp://127.0.0.1:{self.port}"

    def counts(self) -> SinkCounts:
        return read_counts(self.proc.log_path)

    def messages(self) -> int:
        """Messages taken so far (each counted when its final "." arrives)."""
        return self.counts().messages

    def wait_messages(self, count: int, timeout: float) -> int:
        """Block until at least ``count`` messages were taken (or ``timeout``); how many."""
        deadline = time.monotonic() + timeout
        while (got := self.messages()) < count and time.monotonic() < deadline:
            self.proc.check_alive()
            time.sleep(0.01)
        return got


def sink_command(
    tools: PostfixTools, port: int, *, max_connections: int = 1024, backlog: int = 1024
) -> list[str]:
    cmd = [str(tools.sink), "-c", "-m", str(max_connections)]
    if os.geteuid() == 0:
        # As root, smtp-sink refuses to run without dropping its privileges.
        cmd += ["-u", "nobody"]
    return [*cmd, f"127.0.0.1:{port}", str(backlog)]


def _wait_listening(proc: Managed, port: int, timeout: float = 10.0) -> bool:
    """True once the port accepts; False if smtp-sink exited (e.g. the port was taken)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            return False
        if port_accepts(port):
            return True
        time.sleep(0.02)
    raise TimeoutError(f"{proc.name} did not accept on port {port} within {timeout}s")


@contextlib.contextmanager
def postfix_sink(
    workdir: Path,
    name: str,
    *,
    tools: PostfixTools | None = None,
    max_connections: int = 1024,
    backlog: int = 1024,
) -> Iterator[PostfixSink]:
    """Run smtp-sink on a free port of 127.0.0.1 as its own process; stop it on exit.

    Its counters and any error go to ``workdir/<name>.log``.
    """
    tools = tools or ensure_tools()
    for _attempt in range(3):
        port = free_port()
        cmd = sink_command(tools, port, max_connections=max_connections, backlog=backlog)
        with managed(
            name, cmd, log_path=workdir / f"{name}.log", env=tools.env(), stop_timeout=10
        ) as proc:
            if _wait_listening(proc, port):
                yield PostfixSink(port, proc, tools)
                return
        # Another process took the free port before smtp-sink bound it: a new one.
    raise RuntimeError(f"{name} exited at start three times; see {workdir / f'{name}.log'}")


# ---- the sink's own ceiling -------------------------------------------------


@dataclass(frozen=True)
class CeilingConfig:
    sessions: int = 16  # parallel SMTP sessions of smtp-source
    messages: int = 50_000  # per run with kept connections
    new_connection_messages: int = 10_000  # per run with one connection per message
    length: int = 300  # payload bytes per message, headers not included
    reps: int = 3
    quiet_below_pct: float = 40.0
    quiet_max_wait_s: float = 15.0

    @classmethod
    def smoke(cls, **overrides: Any) -> CeilingConfig:
        return cls(**{"messages": 2000, "new_connection_messages": 1000, "reps": 1} | overrides)


# label -> (smtp-source options, how many messages the config sends)
MODES = {
    "kept connections": ("-d", "messages"),
    "a connection per message": ("", "new_connection_messages"),
}


def source_command(
    tools: PostfixTools, port: int, *, sessions: int, messages: int, length: int, keep: bool
) -> list[str]:
    cmd = [str(tools.source), *(["-d"] if keep else [])]
    cmd += ["-s", str(sessions), "-m", str(messages), "-l", str(length)]
    cmd += ["-M", "localhost", "-f", "bench@localhost", "-t", "sink@localhost"]
    return [*cmd, f"127.0.0.1:{port}"]


def _one_run(
    sink: PostfixSink, cfg: CeilingConfig, messages: int, keep: bool, log: Path
) -> dict[str, Any]:
    cmd = source_command(
        sink.tools,
        sink.port,
        sessions=cfg.sessions,
        messages=messages,
        length=cfg.length,
        keep=keep,
    )
    before = sink.messages()
    cpu0 = cpu_snapshot(sink.proc.pid)
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, env=sink.tools.env(), capture_output=True, text=True, timeout=300, check=False
    )
    wall = time.monotonic() - t0
    cpu = cpu_usage(cpu0, cpu_snapshot(sink.proc.pid))
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise RuntimeError(f"smtp-source exited {proc.returncode}: {proc.stderr.strip()[:500]}")
    taken = sink.wait_messages(before + messages, timeout=5) - before
    return {
        "messages": messages,
        "taken": taken,
        "seconds": round(wall, 4),
        "messages_per_s": round(taken / wall, 1),
        # The sink's CPU per message: what it will take from toko's two cores.
        "sink_cpu_us_per_message": round(cpu["server_pct"] / 100 * wall / taken * 1e6, 2)
        if taken
        else None,
        "cpu": cpu,  # server = smtp-sink, children = smtp-source
    }


def measure_ceiling(cfg: CeilingConfig, workdir: Path) -> dict[str, Any]:
    """Messages/s smtp-sink takes from smtp-source on this machine, both connection modes.

    Runs alternate between the modes within each repetition; one sink serves all.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    tools = ensure_tools()
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in MODES}
    with postfix_sink(workdir, "smtp-sink", tools=tools) as sink:
        for rep in range(cfg.reps):
            for label, (opt, count_field) in MODES.items():
                quiet = wait_for_quiet(cfg.quiet_below_pct, cfg.quiet_max_wait_s)
                count = getattr(cfg, count_field)
                run = _one_run(sink, cfg, count, opt == "-d", workdir / "smtp-source.log")
                run["before"] = quiet
                runs[label].append(run)
                print(
                    f"  rep {rep + 1} {label:24s} {run['messages_per_s']:8.0f} msg/s"
                    f"  sink {run['cpu']['server_pct']:.0f} % ({run['sink_cpu_us_per_message']}"
                    f" µs/msg), smtp-source {run['cpu']['children_pct']:.0f} %,"
                    f" others {run['cpu']['others_pct']:.0f} %",
                    flush=True,
                )
        final = sink.counts()
    summary: dict[str, Any] = {}
    for label, rs in runs.items():
        summary[label] = {
            "messages_per_s": spread([r["messages_per_s"] for r in rs]),
            "sink_cpu_us_per_message": spread(
                [r["sink_cpu_us_per_message"] for r in rs if r["sink_cpu_us_per_message"]]
            ),
            "sink_cpu_pct": spread([r["cpu"]["server_pct"] for r in rs]),
            "source_cpu_pct": spread([r["cpu"]["children_pct"] for r in rs]),
            "others_pct": spread([r["cpu"]["others_pct"] for r in rs]),
            "all_taken": all(r["taken"] == r["messages"] for r in rs),
        }
    return {
        "config": {
            "sessions": cfg.sessions,
            "messages": cfg.messages,
            "new_connection_messages": cfg.new_connection_messages,
            "length": cfg.length,
            "reps": cfg.reps,
            "postfix_version": tools.version,
        },
        "runs": runs,
        "summary": summary,
        "sink_counts": vars(final),
    }


def report_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows for bench.report: (scenario, measure, value, target)."""
    c = result["config"]
    out: list[tuple[str, str, str, str]] = []
    for label, s in result["summary"].items():
        count = c["messages"] if label == "kept connections" else c["new_connection_messages"]
        cost: Spread = s["sink_cpu_us_per_message"]
        out.append(
            (
                f"(h) SMTP sink ceiling, {label}",
                f"Postfix {c['postfix_version']} smtp-sink fed by smtp-source, {c['sessions']}"
                f" sessions, {count} x {c['length']} B, median of {c['reps']}:"
                " messages/s · sink CPU per message · sink · smtp-source CPU",
                f"{fmt_spread(s['messages_per_s'])} · {fmt_spread(cost, '{:.1f}', ' µs')}"
                f" · {s['sink_cpu_pct']['median']:.0f} % · {s['source_cpu_pct']['median']:.0f} %"
                f" (others {s['others_pct']['median']:.0f} %)",
                "all taken ✅" if s["all_taken"] else "all taken ❌",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.postfix",
        description="Fetch and unpack Postfix's smtp-sink and smtp-source for the bench "
        "(idempotent; nothing is installed) and print their paths.",
    )
    parser.add_argument("--cache", type=Path, default=CACHE, help="default: %(default)s")
    args = parser.parse_args(argv)
    try:
        tools = ensure_tools(args.cache)
    except ProvisionError as exc:
        print(f"bench.postfix: {exc}", file=sys.stderr)
        return 1
    print(f"postfix {tools.version}")
    print(f"smtp-sink    {tools.sink}")
    print(f"smtp-source  {tools.source}")
    print(f"LD_LIBRARY_PATH={tools.libdir}")
    print(f"man pages    {tools.man_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
