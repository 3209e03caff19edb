"""When PostgreSQL's autovacuum ran during a run of the disk scenario (g).

Under (g)'s steady inserts, the server's autovacuum visits each new table
once its inserts pass the insert threshold: about a minute after a database
is made it vacuums and analyzes ``jobs`` and ``products``, some 0.5 s of
reading, dirtying and writing every page of both, on the two cores and the
disk toko-api and the server share, and the windows it falls in are often
the run's slowest (figures in docs/benchmarks.md, "The disk under steady
load"). So the bench names them rather than leave them a mystery. The
server logs each run (``log_autovacuum_min_duration = 0``, set on the
throwaway cluster by ``log_every_run``) when it ends, with how long it took;
``runs_in_log`` reads them back and ``by_window`` lays them on the windows
of the schedule.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.postgres import PostgresCluster, fetch_sync

# "2026-12-07 12:46:04.923 UTC [18486] LOG:  automatic vacuum of table "db.public.jobs": ..."
_HEAD = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) UTC \[\d+\] LOG:  "
    r'automatic (?:aggressive )?(vacuum|analyze) of table "([^"]+)"'
)
# Its detail lines, indented, end with "system usage: CPU: ... elapsed: 0.37 s".
_ELAPSED = re.compile(r"elapsed: (\d+(?:\.\d+)?) s")


@dataclass(frozen=True)
class Run:
    what: str  # "vacuum" or "analyze"
    table: str  # database.schema.table, as logged
    start: float  # seconds since the epoch
    end: float

    @property
    def database(self) -> str:
        return self.table.split(".", 1)[0]

    @property
    def relation(self) -> str:
        return self.table.rsplit(".", 1)[-1]


def log_every_run(cluster: PostgresCluster) -> None:
    """Have the server log every autovacuum run, its times in UTC."""
    for sql in (
        "ALTER SYSTEM SET log_autovacuum_min_duration = 0",
        "ALTER SYSTEM SET log_timezone = 'UTC'",
        "SELECT pg_reload_conf()",
    ):
        fetch_sync(cluster, cluster.url(), sql)


def log_size(cluster: PostgresCluster) -> int:
    """Where the server's log ends now: pass it to ``runs_in_log`` after the run."""
    return cluster.logfile.stat().st_size


def runs_in_log(logfile: Path, offset: int = 0) -> list[Run]:
    with logfile.open("rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    return parse(text)


def parse(text: str) -> list[Run]:
    """The autovacuum runs a server log tells of, each from its end and elapsed time."""
    runs: list[Run] = []
    head: re.Match[str] | None = None
    elapsed = 0.0
    # One pass: a run is complete when the next unindented line comes.
    for line in [*text.splitlines(), ""]:
        if line.startswith("\t"):
            found = _ELAPSED.search(line)
            if found:
                elapsed = float(found.group(1))
            continue
        if head is not None:
            stamp, what, table = head.groups()
            end = dt.datetime.fromisoformat(stamp).replace(tzinfo=dt.UTC).timestamp()
            runs.append(Run(what, table, end - elapsed, end))
        head, elapsed = _HEAD.match(line), 0.0
    return runs


def by_window(
    runs: Sequence[Run], *, t0: float, window_s: float, count: int, database: str
) -> list[list[str]]:
    """For each of ``count`` windows from ``t0`` (epoch seconds), what autovacuum
    did in it: "vacuum jobs" in ``database``, "database template1" for any
    table of another (the server's own catalogs, say)."""
    out: list[list[str]] = [[] for _ in range(count)]
    for run in runs:
        if run.database == database:
            label = f"{run.what} {run.relation}"
        else:
            label = f"database {run.database}"
        first = int((run.start - t0) // window_s)
        last = int((run.end - t0) // window_s)
        for n in range(max(first, 0), min(last, count - 1) + 1):
            if label not in out[n]:
                out[n].append(label)
    return out
