"""The timer jobs' report to node_exporter's textfile collector.

toko-recap and toko-backup run for seconds, so Prometheus never scrapes them.
After each run they leave ``<TOKO_TEXTFILE_DIR>/<job>.prom`` (toko-recap.prom,
toko-backup.prom), which node_exporter's textfile collector exports with the
host's metrics: when the last run ended, when the last one succeeded, how long
it took, its exit status and the job's own figures.

A failed run keeps the last success time and the figures of the previous
file: they say what the last successful run did, which is what "no backup for
26 hours" is measured from. The file is replaced whole (a temporary file in the
same folder, fsynced, renamed), so the collector never reads half of one and a
power cut never leaves an empty one that would forget the last success.

A host without node_exporter has no such folder: nothing is written and
nothing said. A folder the job cannot write costs one warning; the report
never changes how the job ends.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jobs.common import Stopped
from service.settings import ToolSettings
from service.store.disk import fsync_dir

# node_exporter runs as its own user (prometheus on Debian), and the units'
# UMask=0077 would leave the file readable by toko alone.
FILE_MODE = 0o644

Body = Callable[[argparse.Namespace, ToolSettings], int]
# A job's body that also fills in its own figures (name -> value) as it goes.
ReportingBody = Callable[[argparse.Namespace, ToolSettings, dict[str, float]], int]


@dataclass(frozen=True)
class Run:
    """One run of a timer job, as its report tells it."""

    job: str  # the command: toko-recap, toko-backup
    finished: float  # Unix time
    seconds: float
    exit_code: int
    # This run's own figures (name -> value); used only when it succeeded.
    figures: Mapping[str, float] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0


def prefix(job: str) -> str:
    """The metric names' prefix of a job: toko-backup -> toko_backup."""
    return job.replace("-", "_")


def report_path(directory: Path, job: str) -> Path:
    return directory / f"{job}.prom"


def render(run: Run, figure_help: Mapping[str, str], previous: Mapping[str, float]) -> bytes:
    """The text of the report, given the previous report's values (name -> value)."""
    name = prefix(run.job)
    registry = CollectorRegistry()

    def gauge(suffix: str, help_text: str, value: float | None) -> None:
        if value is not None:
            Gauge(f"{name}_{suffix}", help_text, registry=registry).set(value)

    gauge(
        "last_run_timestamp_seconds",
        f"When the last {run.job} run ended, successful or not (Unix time).",
        run.finished,
    )
    last_success = f"{name}_last_success_timestamp_seconds"
    gauge(
        "last_success_timestamp_seconds",
        f"When the last successful {run.job} run ended (Unix time); 0: none has succeeded.",
        run.finished if run.succeeded else previous.get(last_success, 0.0),
    )
    gauge("last_run_duration_seconds", f"How long the last {run.job} run took.", run.seconds)
    gauge(
        "last_run_exit_code",
        f"The exit status of the last {run.job} run: 0 succeeded (see man {run.job}).",
        run.exit_code,
    )
    for suffix, help_text in figure_help.items():
        value = run.figures.get(suffix) if run.succeeded else previous.get(f"{name}_{suffix}")
        gauge(suffix, help_text, value)
    return generate_latest(registry)


def read_previous(path: Path) -> dict[str, float]:
    """The values of the report at ``path`` (name -> value); nothing if unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if not sample.labels
        }
    except (OSError, ValueError):
        # None yet (the first run), or not ours to read: the last success is
        # then unknown, and a file that is not a report is replaced.
        return {}


def write_atomically(path: Path, text: bytes) -> None:
    """Replace ``path`` with ``text``: readers see the old file or the new one, whole."""
    # Hidden and not *.prom: the collector reads only *.prom files, so it
    # never sees this one half-written.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(text)
            out.flush()
            os.fchmod(out.fileno(), FILE_MODE)
            # Before the rename: after a power cut, a renamed file whose data
            # never reached the disk reads as empty, and the last success with it.
            os.fsync(out.fileno())
        os.rename(tmp, path)
    except BaseException:  # Stopped (SIGTERM) included: no temporary file left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_report(
    directory: Path, run: Run, figure_help: Mapping[str, str], log: logging.Logger
) -> bool:
    """Write ``run``'s report into ``directory``; whether it was written.

    Never raises for the folder: missing is silent (no node_exporter here),
    anything else wrong is one warning.
    """
    try:
        if not stat.S_ISDIR(directory.stat().st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(directory))
    except FileNotFoundError:
        log.debug("no folder %s: no report for node_exporter", directory)
        return False
    except OSError as exc:
        _warn(log, run, directory, exc)
        return False
    path = report_path(directory, run.job)
    try:
        write_atomically(path, render(run, figure_help, read_previous(path)))
    except OSError as exc:
        _warn(log, run, directory, exc)
        return False
    return True


def _warn(log: logging.Logger, run: Run, directory: Path, exc: OSError) -> None:
    log.warning(
        "no report for node_exporter's textfile collector in %s: %s (TOKO_TEXTFILE_DIR;"
        " the run itself is not affected)",
        directory,
        exc.strerror or exc,
        extra={"TEXTFILE_DIR": str(directory)},
    )


def exit_code_of(exc: BaseException) -> int:
    """The exit status ``run_job`` (jobs.common) and Python give a run ended by ``exc``."""
    if isinstance(exc, Stopped):
        return 128 + signal.SIGTERM
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1  # JobFailed, and any other exception (a traceback)


def reported(
    job: str,
    figure_help: Mapping[str, str],
    body: ReportingBody,
    *,
    when: Callable[[argparse.Namespace], bool] = lambda args: True,
) -> Body:
    """``body`` as a ``run_job`` body that reports each run (where ``when`` says so:
    a backup, not an admin's ``--list``). ``figure_help``: the job's figures,
    name -> help text (they are the last successful run's); the body sets
    their values in the dict it is given."""

    def run(args: argparse.Namespace, settings: ToolSettings) -> int:
        if not when(args):
            return body(args, settings, {})
        log = logging.getLogger(f"toko.{job.removeprefix('toko-')}")
        figures: dict[str, float] = {}
        started = time.monotonic()  # not the wall clock: a clock step is no duration

        def report(exit_code: int) -> None:
            finished = Run(job, time.time(), time.monotonic() - started, exit_code, figures)
            try:
                write_report(Path(settings.textfile.dir), finished, figure_help, log)
            except Exception:  # a fault of the report's own must not change the run's end
                log.warning("no report for node_exporter's textfile collector", exc_info=True)

        try:
            code = body(args, settings, figures)
        except BaseException as exc:
            report(exit_code_of(exc))
            raise
        report(code)
        return code

    return run
