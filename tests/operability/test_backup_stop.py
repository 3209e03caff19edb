"""toko-backup stopped mid-copy leaves no partial copy behind.

systemd stops a run with SIGTERM (systemctl stop, the unit's TimeoutStartSec=,
a shutdown), then SIGKILL if it is still there. A partial copy is as large as
the database and sits beside it, hidden from --list and pruning: each one
left behind costs that much disk for good. The runs here are the real script
on a real ~100 MB database; SIGSTOP freezes a run while its partial copy
exists, so each signal lands mid-copy however fast the machine is.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs import sqlite_backup
from tests.operability.cli import BIN, environment, freeze_mid_copy, padded_toko_database, partials


@pytest.fixture
async def database(tmp_path: Path) -> Path:
    return await padded_toko_database(tmp_path / "toko.db", 25000)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """Runs a test starts; any still there at the end (frozen, say) are killed."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def start_backup(
    started: list[subprocess.Popen[str]], database: Path, folder: Path
) -> subprocess.Popen[str]:
    env = {"TOKO_DATABASE": str(database), "TOKO_BACKUP_DIR": str(folder)}
    proc = subprocess.Popen(
        [str(BIN / "toko-backup")],
        env=environment(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started.append(proc)
    return proc


def test_sigterm_mid_copy_removes_the_partial_copy_and_fails(
    database: Path, tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    folder = tmp_path / "backups"
    proc = start_backup(started, database, folder)
    assert freeze_mid_copy(proc, folder)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    # Non-zero, so systemd marks the run failed and OnFailure= alerts.
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert err.splitlines() == ["toko-backup: stopped by SIGTERM before it finished"]
    assert partials(folder) == []
    assert sqlite_backup.list_backups(folder) == []


def test_the_next_run_removes_the_partial_copy_of_a_killed_run(
    database: Path, tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    folder = tmp_path / "backups"
    killed = start_backup(started, database, folder)
    left = freeze_mid_copy(killed, folder)
    killed.kill()  # SIGKILL: what TimeoutStopSec= sends; nothing runs after it
    killed.communicate(timeout=60)
    assert partials(folder) == left
    # Not toko's temporary names: never touched.
    others = [folder / ".notes.partial", folder / "toko-notes.db.partial"]
    for path in others:
        path.write_text("mine")

    proc = start_backup(started, database, folder)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert partials(folder) == []
    assert len(sqlite_backup.list_backups(folder)) == 1
    assert all(path.read_text() == "mine" for path in others)
    removed = [line for line in out.splitlines() if "removed the partial copy" in line]
    assert len(removed) == len(left), out


def test_a_second_run_waits_for_the_first_and_leaves_its_copy_alone(
    database: Path, tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    # A manual run while the timer's runs: the partial copy it finds is live.
    folder = tmp_path / "backups"
    first = start_backup(started, database, folder)
    left = freeze_mid_copy(first, folder)
    second = start_backup(started, database, folder)
    assert second.stdout is not None
    for line in second.stdout:
        if "another toko-backup is writing to this folder; waiting" in line:
            break
    else:
        pytest.fail(f"the second run did not wait (exit code {second.wait()})")
    assert partials(folder) == left
    first.send_signal(signal.SIGCONT)
    for proc in (first, second):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, (out, err)
    assert len(sqlite_backup.list_backups(folder)) == 2
    assert partials(folder) == []
