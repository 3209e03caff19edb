"""The timer jobs' reports for node_exporter's textfile collector (jobs.textfile)."""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs import textfile
from jobs.common import JobFailed, Stopped
from jobs.textfile import Run, read_previous, write_report
from service.settings import TextfileSettings, ToolSettings

HELP = {"size_bytes": "Size of the backup the last successful run wrote."}
LOG = logging.getLogger("toko.backup")


def values(path: Path) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(path.read_text())
        for s in family.samples
    }


def backup_run(finished: float, exit_code: int = 0, size: float = 4096) -> Run:
    return Run("toko-backup", finished, 1.25, exit_code, {"size_bytes": size})


def test_a_successful_run_reports_everything(tmp_path: Path) -> None:
    assert write_report(tmp_path, backup_run(1_800_000_000.5), HELP, LOG)
    assert values(tmp_path / "toko-backup.prom") == {
        "toko_backup_last_run_timestamp_seconds": 1_800_000_000.5,
        "toko_backup_last_success_timestamp_seconds": 1_800_000_000.5,
        "toko_backup_last_run_duration_seconds": 1.25,
        "toko_backup_last_run_exit_code": 0,
        "toko_backup_size_bytes": 4096,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toko-backup.prom"]


def test_a_failed_run_keeps_the_last_success_and_its_figures(tmp_path: Path) -> None:
    write_report(tmp_path, backup_run(1_800_000_000.0, size=4096), HELP, LOG)
    write_report(tmp_path, backup_run(1_800_086_400.0, exit_code=1, size=0), HELP, LOG)
    got = values(tmp_path / "toko-backup.prom")
    assert got["toko_backup_last_run_timestamp_seconds"] == 1_800_086_400.0
    assert got["toko_backup_last_run_exit_code"] == 1
    assert got["toko_backup_last_success_timestamp_seconds"] == 1_800_000_000.0
    assert got["toko_backup_size_bytes"] == 4096
    # And across a second failure, read back from the file the first one wrote.
    write_report(tmp_path, backup_run(1_800_172_800.0, exit_code=143), HELP, LOG)
    got = values(tmp_path / "toko-backup.prom")
    assert got["toko_backup_last_success_timestamp_seconds"] == 1_800_000_000.0
    assert got["toko_backup_last_run_exit_code"] == 143


def test_never_a_success_is_a_last_success_at_0_and_no_figures(tmp_path: Path) -> None:
    # 0, not absent: "no backup for 26 hours" fires on it.
    write_report(tmp_path, backup_run(1_800_000_000.0, exit_code=1), HELP, LOG)
    got = values(tmp_path / "toko-backup.prom")
    assert got["toko_backup_last_success_timestamp_seconds"] == 0
    assert "toko_backup_size_bytes" not in got


def test_a_file_that_is_not_a_report_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "toko-backup.prom").write_text("not { metrics\n")
    assert read_previous(tmp_path / "toko-backup.prom") == {}
    assert write_report(tmp_path, backup_run(1_800_000_000.0), HELP, LOG)
    assert values(tmp_path / "toko-backup.prom")["toko_backup_size_bytes"] == 4096


def test_the_report_replaces_the_file_by_a_rename(tmp_path: Path) -> None:
    # A reader that opened the old file reads it whole; the new one is another
    # file (inode) from the start: the collector never sees half of either.
    target = tmp_path / "toko-backup.prom"
    write_report(tmp_path, backup_run(1_800_000_000.0, size=1), HELP, LOG)
    old_text = target.read_text()
    with target.open() as reader:
        old_inode = os.fstat(reader.fileno()).st_ino
        write_report(tmp_path, backup_run(1_800_000_100.0, size=2), HELP, LOG)
        assert reader.read() == old_text
    assert target.stat().st_ino != old_inode
    assert values(target)["toko_backup_size_bytes"] == 2


def test_a_run_stopped_while_writing_leaves_the_old_report_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "toko-backup.prom"
    write_report(tmp_path, backup_run(1_800_000_000.0, size=1), HELP, LOG)
    before = target.read_bytes()

    def sigterm(fd: int) -> None:
        raise Stopped

    monkeypatch.setattr(textfile.os, "fsync", sigterm)
    with pytest.raises(Stopped):
        write_report(tmp_path, backup_run(1_800_000_100.0, size=2), HELP, LOG)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["toko-backup.prom"]


def test_the_report_is_readable_by_node_exporter_whatever_the_umask(tmp_path: Path) -> None:
    # The units run with UMask=0077; node_exporter runs as user prometheus.
    previous = os.umask(0o077)
    try:
        write_report(tmp_path, backup_run(1_800_000_000.0), HELP, LOG)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "toko-backup.prom").stat().st_mode) == 0o644


def test_a_missing_folder_is_silent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="toko")
    assert not write_report(tmp_path / "none", backup_run(1_800_000_000.0), HELP, LOG)
    assert not (tmp_path / "none").exists()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_a_file_where_the_folder_should_be_is_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "node-exporter").write_text("")
    assert not write_report(tmp_path / "node-exporter", backup_run(1.0), HELP, LOG)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "node-exporter" in record.getMessage() and "TOKO_TEXTFILE_DIR" in record.getMessage()


def settings_for(folder: Path) -> ToolSettings:
    return ToolSettings(textfile=TextfileSettings(dir=str(folder)))


def test_a_reported_job_ends_as_its_body_does(tmp_path: Path) -> None:
    def backup(args: argparse.Namespace, settings: ToolSettings, figures: dict[str, float]) -> int:
        figures["size_bytes"] = 123
        return 0

    def broken(args: argparse.Namespace, settings: ToolSettings, figures: dict[str, float]) -> int:
        raise JobFailed("no database")

    args = argparse.Namespace()
    assert textfile.reported("toko-backup", HELP, backup)(args, settings_for(tmp_path)) == 0
    assert values(tmp_path / "toko-backup.prom")["toko_backup_size_bytes"] == 123
    with pytest.raises(JobFailed):
        textfile.reported("toko-backup", HELP, broken)(args, settings_for(tmp_path))
    got = values(tmp_path / "toko-backup.prom")
    assert (got["toko_backup_last_run_exit_code"], got["toko_backup_size_bytes"]) == (1, 123)


def test_a_fault_of_the_report_itself_is_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def render(*args: object) -> bytes:
        raise RuntimeError("a bug")

    monkeypatch.setattr(textfile, "render", render)
    body = textfile.reported("toko-backup", HELP, lambda args, settings, figures: 3)
    assert body(argparse.Namespace(), settings_for(tmp_path)) == 3
    (record,) = caplog.records
    assert record.levelno == logging.WARNING


def test_exit_codes_as_run_job_gives_them() -> None:
    assert textfile.exit_code_of(JobFailed("x")) == 1
    assert textfile.exit_code_of(Stopped()) == 143
    assert textfile.exit_code_of(RuntimeError()) == 1
    assert textfile.exit_code_of(SystemExit(2)) == 2
