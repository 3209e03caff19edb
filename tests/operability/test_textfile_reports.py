"""toko-recap and toko-backup, run as real processes, report to node_exporter's
textfile folder (TOKO_TEXTFILE_DIR); a folder missing or not writable never
changes how they end. The read-only folder is a real read-only tmpfs (root:
root writes past mode bits, so a chmod 0500 would prove nothing)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.store.sqlite import SqliteStore
from tests.operability.cli import Completed, mount_tmpfs, run


def values(path: Path) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(path.read_text())
        for s in family.samples
    }


@pytest.fixture
async def database(tmp_path: Path) -> Path:
    path = tmp_path / "toko.db"
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    return path


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "node-exporter", "ro,size=100k")


async def run_job(job: str, database: Path, textfile_dir: Path, *args: str) -> Completed:
    env = {
        "TOKO_DATABASE": str(database),
        "TOKO_BACKUP_DIR": str(database.parent / "backups"),
        "TOKO_TEXTFILE_DIR": str(textfile_dir),
    }
    return await run(job, *args, env=env)


def listing(folder: Path, pattern: str = "*") -> list[str]:
    return sorted(p.name for p in folder.glob(pattern))


def warnings(done: Completed) -> list[str]:
    return [r["message"] for r in done.log_records() if r["level"] == "WARNING"]


async def test_each_job_reports_its_run_and_figures(database: Path, tmp_path: Path) -> None:
    folder = tmp_path / "node-exporter"
    folder.mkdir()
    started = time.time()
    recap = await run_job("toko-recap", database, folder)
    backup = await run_job("toko-backup", database, folder)
    assert (recap.returncode, backup.returncode) == (0, 0), (recap, backup)
    assert listing(folder) == ["toko-backup.prom", "toko-recap.prom"]
    got = values(folder / "toko-recap.prom")
    assert started < got["toko_recap_last_run_timestamp_seconds"] <= time.time()
    last_run = got["toko_recap_last_run_timestamp_seconds"]
    assert got["toko_recap_last_success_timestamp_seconds"] == last_run
    assert 0 < got["toko_recap_last_run_duration_seconds"] < 60
    assert got["toko_recap_last_run_exit_code"] == 0
    assert (got["toko_recap_days_recorded"], got["toko_recap_products_new"]) == (1, 0)
    got = values(folder / "toko-backup.prom")
    (written,) = listing(database.parent / "backups", "toko-*.db")
    assert got["toko_backup_size_bytes"] == (database.parent / "backups" / written).stat().st_size
    assert got["toko_backup_last_run_exit_code"] == 0
    # A second recap of the same day: a success that recorded nothing.
    again = await run_job("toko-recap", database, folder)
    assert again.returncode == 0
    assert values(folder / "toko-recap.prom")["toko_recap_days_recorded"] == 0


async def test_a_failed_backup_keeps_the_last_success(database: Path, tmp_path: Path) -> None:
    folder = tmp_path / "node-exporter"
    folder.mkdir()
    assert (await run_job("toko-backup", database, folder)).returncode == 0
    succeeded = values(folder / "toko-backup.prom")
    failed = await run_job("toko-backup", tmp_path / "gone.db", folder)
    assert failed.returncode == 1
    got = values(folder / "toko-backup.prom")
    assert got["toko_backup_last_run_exit_code"] == 1
    assert (
        got["toko_backup_last_run_timestamp_seconds"]
        > (succeeded["toko_backup_last_run_timestamp_seconds"])
    )
    for kept in ("toko_backup_last_success_timestamp_seconds", "toko_backup_size_bytes"):
        assert got[kept] == succeeded[kept], kept


async def test_an_admins_list_is_no_run_to_report(database: Path, tmp_path: Path) -> None:
    folder = tmp_path / "node-exporter"
    folder.mkdir()
    listed = await run_job("toko-backup", database, folder, "--list")
    assert listed.returncode == 0
    assert listing(folder) == []


@pytest.mark.parametrize("job", ["toko-recap", "toko-backup"])
async def test_without_the_folder_nothing_changes(database: Path, tmp_path: Path, job: str) -> None:
    done = await run_job(job, database, tmp_path / "no-node-exporter")
    assert done.returncode == 0, done
    assert (warnings(done), done.stderr) == ([], "")
    assert not (tmp_path / "no-node-exporter").exists()


@pytest.mark.root
@pytest.mark.parametrize("job", ["toko-recap", "toko-backup"])
async def test_a_folder_it_cannot_write_is_one_warning_and_the_run_ends_as_it_would(
    database: Path, read_only_folder: Path, job: str
) -> None:
    done = await run_job(job, database, read_only_folder)
    assert done.returncode == 0, done
    (warning,) = warnings(done)
    assert str(read_only_folder) in warning and "Read-only file system" in warning
    assert listing(read_only_folder) == []
    if job == "toko-backup":
        assert len(listing(database.parent / "backups", "toko-*.db")) == 1
    # A failed run too ends as it would: exit 1, its one error line, one warning.
    failed = await run_job(job, database.parent / "gone.db", read_only_folder)
    assert failed.returncode == 1
    assert len(failed.stderr.splitlines()) == 1 and len(warnings(failed)) == 1
