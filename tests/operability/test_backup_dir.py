"""toko-backup with a backup directory it cannot use, or that fills up mid-copy.

Each ends the run with exit 1 and one line that says where, naming
TOKO_BACKUP_DIR when the directory itself is the trouble; a full disk leaves
no partial copy and keeps the backups already there. The runs are the real
script; the full and the read-only disks are real tmpfs mounts (root).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs import sqlite_backup
from tests.operability.cli import mount_tmpfs, padded_toko_database, partials, run


@pytest.fixture
async def database(tmp_path: Path) -> Path:
    """A toko database of about 800 KiB: more than the small disk below holds."""
    return await padded_toko_database(tmp_path / "toko.db", 200)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "small", "size=400k")


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "ro", "ro,size=100k")


async def backup_into(database: Path, folder: Path) -> tuple[int, list[str]]:
    done = await run(
        "toko-backup", env={"TOKO_DATABASE": str(database), "TOKO_BACKUP_DIR": str(folder)}
    )
    return done.returncode, done.stderr.splitlines()


@pytest.mark.parametrize(
    ("where", "reason"),
    [("a-file", "it is not a directory"), ("a-file/backups", "Not a directory")],
)
async def test_a_backup_directory_that_cannot_be_one_is_named_in_one_line(
    database: Path, tmp_path: Path, where: str, reason: str
) -> None:
    (tmp_path / "a-file").write_text("an admin's notes")
    folder = tmp_path / where
    code, err = await backup_into(database, folder)
    assert code == 1
    assert err == [f"toko-backup: cannot use {folder} for backups (TOKO_BACKUP_DIR): {reason}"]
    assert (tmp_path / "a-file").read_text() == "an admin's notes"


async def test_listing_a_backup_directory_that_is_a_file_fails_instead_of_showing_none(
    database: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "a-file"
    folder.write_text("an admin's notes")
    env = {"TOKO_DATABASE": str(database), "TOKO_BACKUP_DIR": str(folder)}
    listed = await run("toko-backup", "--list", env=env)
    assert listed.returncode == 1
    assert listed.stderr.splitlines() == [
        f"toko-backup: cannot use {folder} for backups (TOKO_BACKUP_DIR): it is not a directory"
    ]
    # No folder yet: no backups yet, and where it looked (stdout stays empty).
    env["TOKO_BACKUP_DIR"] = str(tmp_path / "none")
    listed = await run("toko-backup", "--list", env=env)
    assert (listed.returncode, listed.stdout) == (0, "")
    assert listed.stderr == f"toko-backup: no backups in {tmp_path / 'none'} (TOKO_BACKUP_DIR)\n"


@pytest.mark.root
async def test_a_read_only_backup_directory_is_named_in_one_line(
    database: Path, read_only_disk: Path
) -> None:
    code, err = await backup_into(database, read_only_disk)
    assert code == 1
    assert err == [
        f"toko-backup: cannot use {read_only_disk} for backups (TOKO_BACKUP_DIR):"
        " Read-only file system"
    ]


@pytest.mark.root
async def test_a_full_backup_disk_leaves_no_partial_copy_and_keeps_the_older_backups(
    database: Path, small_disk: Path
) -> None:
    older = small_disk / "toko-20261101T023000Z.db"
    older.write_bytes(b"an older backup, small enough to fit")
    code, err = await backup_into(database, small_disk)
    assert code == 1
    # SQLite's words alone ("database or disk is full") did not say which disk.
    assert err == [
        f"toko-backup: copying {database} into {small_disk} failed: database or disk is full"
    ]
    assert partials(small_disk) == []
    assert sqlite_backup.list_backups(small_disk) == [older]
    assert older.read_bytes() == b"an older backup, small enough to fit"
