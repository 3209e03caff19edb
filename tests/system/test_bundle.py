"""The deployment bundle on a real systemd: Debian booted in systemd-nspawn,
toko installed from its package.

The tests share one machine per suite and run in file order; each starts from
a running toko-api (the ``toko`` fixture restarts it if a test left it down),
and the ones that change the configuration put it back. What the package
itself does (install, upgrade, remove, purge) is in test_package.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trustme

from jobs.queue_admin import PG_HINT
from tests.support.faults import FATAL_PRODUCT, FATAL_WRITER
from tests.support.postgres import acquire_cluster, fetch_sync, release_cluster
from tests.support.smtp import SmtpServer, server_tls
from tests.support.syscalls import SYNCS, numbered, synced, trace_command, where
from tests.system.deployment import (
    ENV_FILE,
    HARDENING_DROP_IN,
    INSTALLED_UNITS,
    REPO,
    TOKEN_FILE,
    UNIT_DIR,
    VENV_PYTHON,
    Deployment,
)
from tests.system.machine import log, wait_until

# A cold run debootstraps, builds and installs inside the first test's time.
pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

DROP_IN_DIR = "/etc/systemd/system/toko-api.service.d"


def test_api_active_and_serves_from_host(toko: Deployment) -> None:
    assert toko.machine.run(["systemctl", "is-active", "toko-api"]).stdout.strip() == "active"
    since = toko.now()
    product = toko.post_product("Kopi Toraja", 45000)
    assert product["nama"] == "Kopi Toraja" and product["harga"] == 45000
    got = toko.request("GET", f"/produk/{product['id']}")
    assert got.status == 200 and got.body["id"] == product["id"]

    # Zero configuration: the email goes to the log mailer, i.e. the journal.
    def logged() -> list[dict[str, Any]]:
        return [
            e
            for e in toko.journal("toko-api", since)
            if e.get("MESSAGE") == "email logged" and "Kopi Toraja" in str(e.get("SUBJECT", ""))
        ]

    entries = wait_until(logged, 30, "an 'email logged' journal entry for the product")
    assert entries[0].get("TO") == "admin@toko.com"


def test_socket_from_unit_and_drop_in(toko: Deployment) -> None:
    # The shipped default, and the admin's drop-in (this test's port) winning.
    unit = toko.machine.run(["cat", f"{UNIT_DIR}/toko-api.socket"]).stdout
    assert "ListenStream=127.0.0.1:8080" in unit
    assert toko.show("toko-api.socket", "Listen") == f"127.0.0.1:{toko.port} (Stream)"
    assert toko.show("toko-api.socket", "ActiveState") == "active"
    enabled = ("toko-api.socket", "toko-api.service", "toko-recap.timer", "toko-backup.timer")
    for unit_name in enabled:
        assert toko.show(unit_name, "UnitFileState") == "enabled", unit_name


def test_timers_listed_with_next_run(toko: Deployment) -> None:
    timers = ("toko-recap.timer", "toko-backup.timer")
    # Not at the instant a timer's run goes on (during its nightly window).
    wait_until(lambda: toko.timers_scheduled(*timers), 60, "both timers listed with a next run")
    for timer in timers:
        assert toko.show(timer, "NextElapseUSecRealtime") not in ("", "0", "n/a")
        assert toko.show(timer, "ActiveState") == "active"


def test_journal_has_identifier_and_job_fields(toko: Deployment) -> None:
    toko.post_product("Teh Melati", 12000)

    def with_job_id() -> list[dict[str, Any]]:
        return [
            e
            for e in toko.journal("toko-api")
            if e.get("SYSLOG_IDENTIFIER") == "toko-api" and e.get("JOB_ID")
        ]

    entries = wait_until(with_job_id, 30, "a toko-api journal entry with JOB_ID")
    assert all(re.fullmatch(r"\d+", str(e["JOB_ID"])) for e in entries)


def test_units_verify_clean_and_exposure(toko: Deployment) -> None:
    paths = [f"{UNIT_DIR}/{u}" for u in INSTALLED_UNITS]
    proc = toko.machine.run(["systemd-analyze", "verify", *paths], check=False)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc
    for unit in ("toko-api.service", "toko-recap.service", "toko-backup.service"):
        for offline in ([], ["--offline=true", f"{UNIT_DIR}/{unit}"]):
            argv = ["systemd-analyze", "security", "--no-pager", *(offline or [unit])]
            out = toko.machine.run(argv, check=False).stdout
            match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
            assert match, out
            log(f"{toko.machine.suite}: exposure of {unit} ({argv[-1]}): {match.group(1)}")
            assert float(match.group(1)) <= 2.0, out


# What `systemd-analyze security` has rated every toko service since the sandbox was written.
EXPOSURE_MAX = 1.1


def toko_services(toko: Deployment) -> tuple[list[str], list[str]]:
    """The toko services' unit files as systemd lists them, and the units they run as.

    Listed, not named here: a service added to the bundle is checked too. The
    template runs as an instance; one named as OnFailure= names them.
    """
    listed = toko.machine.run(
        ["systemctl", "list-unit-files", "--no-legend", "--type=service", "toko-*"]
    ).stdout
    files = sorted(line.split()[0] for line in listed.splitlines() if line.strip())
    assert files == sorted(u for u in INSTALLED_UNITS if u.endswith(".service")), listed
    units = [f.replace("@.", "@test.") for f in files] + ["toko-alert@toko-backup.service.service"]
    return files, units


def shown(toko: Deployment, unit: str, properties: list[str]) -> dict[str, str]:
    """``systemctl show`` of ``properties`` (unset ones too) of ``unit``."""
    argv = ["systemctl", "show", "--all", "-p", ",".join(properties), unit]
    lines = toko.machine.run(argv).stdout.splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_every_service_gets_all_of_the_shared_sandbox(toko: Deployment) -> None:
    # One drop-in holds the sandbox (deploy/systemd/toko-.service.d/): each
    # service must have all of it as systemd loaded it, not just on paper.
    path = f"{UNIT_DIR}/{HARDENING_DROP_IN}"
    installed = toko.machine.run(["cat", path]).stdout
    assert installed == (REPO / "deploy" / "systemd" / HARDENING_DROP_IN).read_text()
    body = installed.partition("[Service]\n")[2]
    keys = sorted(
        {ln.split("=", 1)[0] for ln in body.splitlines() if ln and not ln.startswith("#")}
    )
    # The values systemd shows for exactly these lines, whatever its format: a
    # unit of them alone, named so that the drop-in does not apply to it.
    reference = "/etc/systemd/system/sandbox-reference.service"
    bare = "/etc/systemd/system/sandbox-bare.service"
    toko.machine.write(reference, f"[Service]\nExecStart=/bin/true\n{body}")
    toko.machine.write(bare, "[Service]\nExecStart=/bin/true\n")
    try:
        toko.machine.run(["systemctl", "daemon-reload"])
        expected = shown(toko, "sandbox-reference.service", keys)
        assert sorted(expected) == keys, expected
        # Each value tells a unit with the line from one without it, but for
        # lines that say what systemd does anyway (kept for the reader).
        default = shown(toko, "sandbox-bare.service", keys)
        same = {key for key in keys if expected[key] == default[key]}
        assert same <= {"AmbientCapabilities", "KeyringMode"}, same
        _, units = toko_services(toko)
        for unit in units:
            got = shown(toko, unit, [*keys, "DropInPaths"])
            assert path in toko.real_paths(*got.pop("DropInPaths").split()), unit
            mismatched = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
            assert not mismatched, (unit, mismatched)
    finally:
        toko.machine.run(["rm", "-f", reference, bare])
        toko.machine.run(["systemctl", "daemon-reload"])


def test_every_service_is_rated_as_the_sandbox_left_it(toko: Deployment) -> None:
    files, units = toko_services(toko)
    runs = [[unit] for unit in units] + [["--offline=true", f"{UNIT_DIR}/{f}"] for f in files]
    rated: dict[str, float] = {}
    for run in runs:
        argv = ["systemd-analyze", "security", "--no-pager", *run]
        out = toko.machine.run(argv, check=False).stdout
        match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
        assert match, out
        rated[run[-1]] = float(match.group(1))
        assert rated[run[-1]] <= EXPOSURE_MAX, out
    log(f"{toko.machine.suite}: exposure: {rated}")


def test_runs_unprivileged_and_confined(toko: Deployment) -> None:
    status = toko.machine.run(["cat", f"/proc/{toko.main_pid()}/status"]).stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uid = toko.machine.run(["id", "-u", "toko"]).stdout.strip()
    assert fields["Uid"].split()[:2] == [uid, uid]
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"  # SystemCallFilter= is in force
    limits = toko.machine.run(["cat", f"/proc/{toko.main_pid()}/limits"]).stdout
    (open_files,) = [row for row in limits.splitlines() if row.startswith("Max open files")]
    # toko-api lifts its soft limit to the hard one (glibc's setrlimit is the
    # prlimit64 call, which the filter lets through); systemd starts it at 1024.
    soft, hard = open_files.split()[3:5]
    assert int(soft) > 1024 and soft == hard, open_files


def test_bad_config_fails_once_with_one_clear_line(toko: Deployment) -> None:
    restarts = toko.n_restarts()
    since = toko.now()
    with toko.settings_added("TOKO_WORKERS=abc"):
        proc = toko.machine.run(["systemctl", "restart", "toko-api.service"], check=False)
        assert proc.returncode != 0
        assert toko.show("toko-api.service", "Result") == "exit-code"
        assert toko.show("toko-api.service", "ExecMainStatus") == "2"
        # RestartPreventExitStatus=2: no restart loop on a config error.
        assert toko.n_restarts() == restarts
        lines = [m for m in toko.messages("toko-api", since) if "TOKO_WORKERS" in m]
        assert lines, toko.messages("toko-api", since)
        # The docs' check of an edited toko.env says the same, and leaves
        # no failed run-u….service behind to mark the system degraded.
        check = doc_block("--check-config")
        checked = toko.machine.run(["bash", "-c", NO_SUDO + check], check=False)
        assert checked.returncode == 2 and "TOKO_WORKERS" in checked.stderr, checked
        assert failed_transient_units(toko) == ""
    toko.ensure_running()


def test_api_token_from_the_installer_reaches_the_sandboxed_service(toko: Deployment) -> None:
    # Written by the package's postinst, readable by root only; LoadCredential= hands it over.
    stat = toko.machine.run(["stat", "-c", "%a %U", "/etc/toko/api-token"]).stdout.split()
    assert stat == ["600", "root"]
    body = {"nama": "Rahasia", "harga": 1}
    assert toko.request("POST", "/produk", body).status == 401
    old = {"Authorization": f"Bearer {toko.token}"}
    assert toko.request("POST", "/produk", body, headers=old).status == 201
    # Rotation as the docs say: a new file, a restart.
    toko.machine.sh(
        "umask 077; head -c 32 /dev/urandom | base64 | tr -d '+/=' > /etc/toko/api-token"
    )
    toko.machine.run(["systemctl", "restart", "toko-api.service"])
    toko.wait_serving()
    assert toko.request("POST", "/produk", body, headers=old).status == 401
    toko.read_token()
    assert toko.post_product("Token baru")["id"] > 0
    # Neither token, used or refused, ever reaches the journal.
    journal = toko.machine.run(["journalctl", "-o", "json", "--no-pager"]).stdout
    assert toko.token not in journal
    assert old["Authorization"].split()[1] not in journal


def test_failed_timer_job_raises_an_alert(toko: Deployment) -> None:
    # A backup that fails: its backup directory is not writable.
    drop_in = "/etc/systemd/system/toko-backup.service.d/fail.conf"
    read_only = "/var/lib/toko/read-only-backups"
    toko.machine.run(["install", "-d", "-o", "toko", "-g", "toko", "-m", "0700", read_only])
    toko.machine.write(
        drop_in,
        f"[Service]\nEnvironment=TOKO_BACKUP_DIR={read_only}\nReadOnlyPaths={read_only}\n",
    )
    since = toko.now()
    try:
        toko.machine.run(["systemctl", "daemon-reload"])
        proc = toko.machine.run(["systemctl", "start", "toko-backup.service"], check=False)
        assert proc.returncode != 0
        assert toko.show("toko-backup.service", "Result") == "exit-code"

        def alerted() -> list[dict[str, Any]]:
            return [
                e
                for e in toko.journal("SYSLOG_IDENTIFIER=toko-alert", since)
                if e.get("UNIT") == "toko-backup.service" and e.get("PRIORITY") == "3"
            ]

        (entry,) = wait_until(alerted, 60, "toko-alert's error entry about toko-backup")
        assert entry.get("SERVICE_RESULT") == "exit-code"
        # toko-backup said itself why, at error priority, in one line.
        own = [e for e in toko.journal("toko-backup", since) if e.get("PRIORITY") == "3"]
        assert any("toko-backup failed" in str(e.get("MESSAGE")) for e in own), own

        def mailed() -> list[dict[str, Any]]:
            return [
                e
                for e in toko.journal("toko-api", since)
                if e.get("MESSAGE") == "email logged"
                and e.get("SUBJECT") == "toko: toko-backup.service failed"
            ]

        wait_until(mailed, 60, "the alert email (log mailer) from toko-api")
    finally:
        toko.machine.run(["rm", "-rf", drop_in, read_only])
        toko.machine.run(["systemctl", "daemon-reload"])
        toko.machine.run(["systemctl", "reset-failed", "toko-backup.service"], check=False)


def test_backup_by_hand_is_verified(toko: Deployment) -> None:
    toko.post_product("Gula Aren", 30000)
    since = toko.now()
    toko.machine.run(["systemctl", "start", "toko-backup.service"], timeout=300)
    assert toko.show("toko-backup.service", "Result") == "success"
    entries = toko.journal("toko-backup", since)
    written = [e for e in entries if e.get("MESSAGE") == "backup written"]
    assert written, toko.messages("toko-backup", since)
    path = str(written[-1]["PATH"])
    assert re.fullmatch(r"/var/lib/toko/backups/toko-\d{8}T\d{6}Z\.db", path), path
    stat = toko.machine.run(["stat", "-c", "%a %U", path]).stdout.split()
    assert stat == ["600", "toko"]
    assert toko.sql_at(path, "PRAGMA integrity_check") == [("ok",)]
    assert toko.sql_at(path, "SELECT count(*) FROM products WHERE nama = 'Gula Aren'") == [(1,)]


def test_backups_outside_the_state_directory_with_the_readmes_drop_in(toko: Deployment) -> None:
    # The sandbox makes everything outside /var/lib/toko read-only; the docs'
    # drop-in (ReadWritePaths=) and TOKO_BACKUP_DIR open one folder for backups.
    drop_in = "/etc/systemd/system/toko-backup.service.d/backup-dir.conf"
    toko.machine.run(
        ["install", "-d", "-o", "toko", "-g", "toko", "-m", "0700", "/srv/toko-backups"]
    )
    toko.machine.write(drop_in, "[Service]\nReadWritePaths=/srv/toko-backups\n")
    with toko.settings_added("TOKO_BACKUP_DIR=/srv/toko-backups"):
        try:
            toko.machine.run(["systemctl", "daemon-reload"])
            since = toko.now()
            toko.machine.run(["systemctl", "start", "toko-backup.service"], timeout=300)
            assert toko.show("toko-backup.service", "Result") == "success", toko.messages(
                "toko-backup", since
            )
            (path,) = toko.machine.run(["ls", "/srv/toko-backups"]).stdout.split()
            full = f"/srv/toko-backups/{path}"
            mode = toko.machine.run(["stat", "-c", "%a %U", full]).stdout.split()
            assert mode == ["600", "toko"]
            assert toko.sql_at(full, "PRAGMA integrity_check") == [("ok",)]
        finally:
            toko.machine.run(["rm", "-rf", drop_in, "/srv/toko-backups"])
            toko.machine.run(["systemctl", "daemon-reload"])


def test_a_database_outside_the_state_directory_fails_once_then_moves_the_readmes_way(
    toko: Deployment,
) -> None:
    # TOKO_DATABASE=/srv/toko/toko.db without the drop-in: toko-api said
    # "[Errno 30] Read-only file system: '/srv/toko/toko.db.lock'" and exited 1,
    # restarted five times until systemd gave up; the timer jobs said "unable
    # to open database file".
    product = toko.post_product("Pindah rumah")
    drop_ins = [
        f"/etc/systemd/system/{unit}.service.d/database.conf"
        for unit in ("toko-api", "toko-recap", "toko-backup", "toko-alert@")
    ]
    line = (
        "TOKO_DATABASE names a file in /srv/toko, which is read-only here: toko's units "
        "may write only in /var/lib/toko unless a drop-in adds ReadWritePaths=/srv/toko "
        "(see /usr/share/doc/toko/docs/how-to/database-elsewhere.md)"
    )
    original = toko.machine.run(["cat", ENV_FILE]).stdout
    try:
        # First made by a plain mkdir, root's: named as such.
        toko.machine.run(["mkdir", "/srv/toko"])
        toko.machine.write(drop_ins[0], "[Service]\nReadWritePaths=/srv/toko\n")
        toko.machine.run(["systemctl", "daemon-reload"])
        since = toko.now()
        with toko.settings_added("TOKO_DATABASE=/srv/toko/toko.db"):
            proc = toko.machine.run(["systemctl", "restart", "toko-api.service"], check=False)
            assert proc.returncode != 0
            assert toko.show("toko-api.service", "ExecMainStatus") == "2"
            owned = "TOKO_DATABASE: /srv/toko belongs to root, and toko cannot write to it"
            assert f"toko-api: {owned}: chown toko: /srv/toko" in toko.messages("toko-api", since)
        toko.machine.run(["rm", drop_ins[0]])
        toko.machine.run(["systemctl", "daemon-reload"])
        toko.machine.run(["chown", "toko:toko", "/srv/toko"])
        toko.machine.run(["systemctl", "reset-failed", "toko-api"], check=False)
        restarts = toko.n_restarts()
        since = toko.now()
        with toko.settings_added("TOKO_DATABASE=/srv/toko/toko.db"):
            proc = toko.machine.run(["systemctl", "restart", "toko-api.service"], check=False)
            assert proc.returncode != 0
            assert toko.show("toko-api.service", "ExecMainStatus") == "2"
            assert toko.n_restarts() == restarts
            assert f"toko-api: {line}" in toko.messages("toko-api", since)
            recap = toko.machine.run(["systemctl", "start", "toko-recap.service"], check=False)
            assert recap.returncode != 0
            assert f"toko-recap: {line}" in toko.messages("toko-recap", since)
        # The docs' way: toko-api stopped, the file moved, the folder given
        # to every unit; the shop goes on where it was.
        toko.machine.run(["systemctl", "reset-failed", "toko-api", "toko-recap"], check=False)
        move = doc_block("ReadWritePaths=/srv/toko")
        toko.machine.run(["bash", "-c", NO_SUDO + move], timeout=300)
        toko.wait_serving()
        response = toko.request("GET", f"/produk/{product['id']}")
        assert response.status == 200, response
        moved = toko.post_product("Di rumah baru")
        rows = toko.sql_at(
            "/srv/toko/toko.db", "SELECT nama FROM products WHERE id = ?", (moved["id"],)
        )
        assert rows == [("Di rumah baru",)]
        for unit in ("toko-recap.service", "toko-backup.service", "toko-alert@test.service"):
            since = toko.now()
            started = toko.machine.run(["systemctl", "start", unit], check=False, timeout=300)
            assert started.returncode == 0, toko.messages(unit, since)
        assert toko.machine.run(["ls", "/srv/toko/backups"]).stdout.strip()
    finally:
        toko.machine.run(["systemctl", "stop", "toko-api.socket", "toko-api.service"])
        toko.machine.run(["sh", "-c", f"cat > {ENV_FILE}"], input=original)
        toko.machine.sh(
            "if [ -e /srv/toko/toko.db ]; then mv /srv/toko/toko.db /var/lib/toko/; fi; "
            f"rm -rf /srv/toko {' '.join(drop_ins)}; systemctl daemon-reload; "
            "systemctl reset-failed toko-api toko-recap toko-alert@test.service || true"
        )
        toko.machine.run(["systemctl", "start", "toko-api.socket", "toko-api.service"])


def test_a_database_copied_in_by_root_fails_once_with_what_to_do(toko: Deployment) -> None:
    # `cp backup.db /var/lib/toko/toko.db` as root, or a folder made with a
    # plain mkdir: toko-api said "unable to open database file", exited 1 and
    # was restarted five times until systemd gave up.
    database = "/var/lib/toko/toko.db"
    toko.machine.run(["systemctl", "stop", "toko-api.socket", "toko-api.service"])
    toko.machine.sh(f"cp {database} /root/copy.db && rm {database} && mv /root/copy.db {database}")
    try:
        since = toko.now()
        restarts = toko.n_restarts()
        proc = toko.machine.run(["systemctl", "start", "toko-api.service"], check=False)
        assert proc.returncode != 0
        assert toko.show("toko-api.service", "ExecMainStatus") == "2"
        assert toko.n_restarts() == restarts
        line = (
            f"TOKO_DATABASE: {database} belongs to root, and toko cannot write to it:"
            f" chown toko: {database}"
        )
        assert f"toko-api: {line}" in toko.messages("toko-api", since)
        backup = toko.machine.run(["systemctl", "start", "toko-backup.service"], check=False)
        assert backup.returncode != 0
        assert f"toko-backup: {line}" in toko.messages("toko-backup", since)
    finally:
        toko.machine.run(["chown", "toko:", database])
        toko.machine.run(["systemctl", "reset-failed", "toko-api", "toko-backup"], check=False)
        toko.machine.run(["systemctl", "start", "toko-api.socket", "toko-api.service"])


def test_toko_queue_says_when_toko_env_changed_after_toko_api_started(toko: Deployment) -> None:
    # toko-queue reads toko.env as it is now, toko-api as it was at its start:
    # after an edit without a restart the two worked on different settings
    # (another TOKO_DATABASE, say) without a word.
    queue = ["runuser", "-u", "toko", "--", "toko-queue", "stats"]
    toko.machine.run(["systemctl", "restart", "toko-api.service"])
    toko.wait_serving()
    assert toko.machine.run(queue).stderr == ""
    with toko.settings_added("TOKO_WORKERS=5", restart=True):
        edited = toko.machine.run(queue)
        warning = (
            "toko-queue: warning: /etc/toko/toko.env changed after toko-api started "
            r"\(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\): toko-api runs with the settings "
            "from before, this command with the new ones "
            r"\(sudo systemctl restart toko-api\)"
        )
        assert re.fullmatch(warning + "\n", edited.stderr), edited.stderr
        assert "pending" in edited.stdout
        # The docs' helper gets the file from systemd-run: the same warning.
        helper = toko.machine.run(["bash", "-c", as_service("toko-queue stats")])
        assert re.fullmatch(warning + "\n", helper.stderr), helper.stderr
        toko.machine.run(["systemctl", "restart", "toko-api.service"])
        toko.wait_serving()
        assert toko.machine.run(queue).stderr == ""


def as_service(command: str) -> str:
    """``command`` run by hand the docs' way: through its ``toko`` helper
    (systemd-run as toko, with the service's settings), as an admin pastes it."""
    block = doc_block("toko toko-backup --list")
    helper = block[: block.index("\n}\n") + 3]
    return NO_SUDO + helper + f"toko {command}\n"


def test_restore_refused_while_running_then_restores(toko: Deployment) -> None:
    # Its own backup: run alone, no earlier test has left one (nor has the timer).
    toko.machine.run(["systemctl", "start", "toko-backup.service"], timeout=300)
    backup = toko.machine.sh("ls /var/lib/toko/backups/toko-*.db").stdout.split()[-1]
    assert backup in toko.machine.sh(as_service("toko-backup --list")).stdout
    in_backup = toko.sql_at(backup, "SELECT count(*) FROM products")[0][0]
    toko.post_product("Tidak di backup")
    proc = toko.machine.sh(as_service(f"toko-backup --restore {backup}"), check=False)
    assert proc.returncode != 0, proc
    assert len(proc.stderr.strip().splitlines()) == 1, proc
    assert "toko-api" in proc.stderr
    assert toko.show("toko-api.service", "ActiveState") == "active"
    # The helper leaves the state directory as the units keep it, and a
    # command that failed no failed unit behind (the system stays "running").
    assert toko.machine.run(["stat", "-c", "%a", "/var/lib/toko"]).stdout.strip() == "700"
    failed = toko.machine.run(["systemctl", "list-units", "--failed", "--no-legend", "run-*"])
    assert failed.stdout.strip() == "", failed.stdout

    toko.machine.run(["systemctl", "stop", "toko-api.socket", "toko-api.service"])
    toko.machine.sh(as_service(f"toko-backup --restore {backup}"))
    toko.machine.run(["systemctl", "start", "toko-api.socket", "toko-api.service"])
    toko.wait_serving()
    assert toko.sql("SELECT count(*) FROM products")[0][0] == in_backup
    assert toko.sql("SELECT count(*) FROM products WHERE nama = 'Tidak di backup'") == [(0,)]
    mode = toko.machine.run(["stat", "-c", "%a %U", "/var/lib/toko/toko.db"]).stdout.split()
    assert mode == ["600", "toko"]


def test_recap_twice_records_once(toko: Deployment) -> None:
    # The default period is yesterday in the machine's time zone.
    yesterday = toko.machine.run(["date", "-d", "yesterday", "+%F"]).stdout.strip()
    # Yesterday not recorded yet, as the day after an install, whatever an
    # earlier test on this machine recorded (the missed timers' test does).
    toko.sql("DELETE FROM recaps WHERE period = ?", (yesterday,))
    periods = toko.sql("SELECT period FROM recaps ORDER BY period")
    emails = (
        "SELECT count(*) FROM jobs WHERE kind = 'recap_email'"
        " AND json_extract(payload, '$.period') = ?"
    )
    (emailed,) = toko.sql(emails, (yesterday,))[0]
    since = toko.now()
    for _ in range(2):
        toko.machine.run(["systemctl", "start", "toko-recap.service"], timeout=300)
        assert toko.show("toko-recap.service", "Result") == "success"
    assert toko.sql("SELECT period FROM recaps ORDER BY period") == [*periods, (yesterday,)]
    assert toko.sql(emails, (yesterday,)) == [(emailed + 1,)]
    messages = toko.messages("toko-recap", since)
    assert any("recap already recorded" in m for m in messages), messages


def test_watchdog_restarts_a_stopped_process(toko: Deployment) -> None:
    pid, restarts = toko.main_pid(), toko.n_restarts()
    toko.machine.sh(f"kill -STOP {pid}")  # the shell's kill: minbase has no procps
    # WatchdogSec=15s, then SIGABRT and the restart.
    wait_until(lambda: toko.n_restarts() > restarts, 60, "a watchdog restart (NRestarts)")
    toko.wait_serving(old_pid=pid)
    assert toko.post_product("Setelah watchdog")["id"] > 0
    messages = toko.messages("toko-api")
    assert any("Watchdog timeout" in m for m in messages)


def test_a_dead_writer_thread_gets_the_service_restarted(toko: Deployment) -> None:
    # toko-api with a bug planted (tests.support.faults): a product named FATAL
    # ends the SQLite writer thread. It must exit 1 for Restart=on-failure.
    folder, drop_in = "/usr/local/lib/toko-test", f"{DROP_IN_DIR}/fatal.conf"
    script = f"{folder}/fatal_writer.py"
    toko.machine.write(script, FATAL_WRITER)
    toko.machine.write(drop_in, f"[Service]\nExecStart=\nExecStart={VENV_PYTHON} {script}\n")
    try:
        toko.machine.run(["systemctl", "daemon-reload"])
        toko.machine.run(["systemctl", "restart", "toko-api.service"], timeout=120)
        pid = toko.wait_serving()
        restarts, since = toko.n_restarts(), toko.now()
        fatal = toko.post(FATAL_PRODUCT)
        assert fatal.status == 503, fatal
        wait_until(lambda: toko.n_restarts() > restarts or None, 60, "a restart (NRestarts)")
        toko.wait_serving(old_pid=pid)
        assert toko.post_product("Setelah pulih")["id"] > 0
        messages = toko.messages("toko-api", since)
        assert any(m.startswith("side task died; stopping") for m in messages), messages
        assert any("status=1/FAILURE" in m for m in messages), messages
    finally:
        toko.machine.run(["rm", "-rf", drop_in, folder])
        toko.machine.run(["systemctl", "daemon-reload"])
        toko.machine.run(["systemctl", "restart", "toko-api.service"], timeout=120)


def test_sighup_leaves_the_service_running(toko: Deployment) -> None:
    # Dying of SIGHUP would be a clean exit to systemd: no restart would follow.
    pid = toko.main_pid()
    # To the main process: enumerating the whole cgroup (the default, "all")
    # once failed with EIO while other containers were busy on the host.
    toko.machine.sh("systemctl kill --kill-who=main --signal=SIGHUP toko-api.service")
    wait_until(
        lambda: any(m.startswith("SIGHUP ignored") for m in toko.messages("toko-api")) or None,
        30,
        "the SIGHUP line in the journal",
    )
    assert toko.show("toko-api.service", "ActiveState") == "active"
    assert toko.main_pid() == pid
    assert toko.post_product("Setelah SIGHUP")["id"] > 0


def test_a_deleted_database_is_saved_inside_the_sandbox(toko: Deployment) -> None:
    # The rescue copy is written by the confined service user, beside the file.
    since = toko.now()
    product = toko.post_product("Sebelum dihapus")
    toko.machine.sh("cd /var/lib/toko && rm -f toko.db toko.db-wal toko.db-shm")
    entry = wait_until(
        lambda: next((e for e in toko.journal("toko-api", since) if "RESCUED" in e), None),
        30,
        "the CRITICAL line with the rescued copy",
    )
    assert entry["PRIORITY"] == "2", entry  # LOG_CRIT
    assert toko.healthz().status == 503
    rescued = str(entry["RESCUED"])
    assert toko.machine.run(["stat", "-c", "%a %U", rescued]).stdout.split() == ["600", "toko"]

    toko.machine.run(["systemctl", "stop", "toko-api.socket", "toko-api.service"])
    toko.machine.run(["mv", rescued, "/var/lib/toko/toko.db"])
    toko.machine.run(["systemctl", "start", "toko-api.socket", "toko-api.service"])
    toko.wait_serving()
    assert toko.sql("SELECT nama FROM products WHERE id = ?", (product["id"],)) == [
        ("Sebelum dihapus",)
    ]
    assert toko.post_product("Setelah dipulihkan")["id"] > product["id"]


def test_restart_under_load_refuses_nothing(toko: Deployment) -> None:
    created: list[tuple[float, int]] = []  # (when the request was sent, product id)
    errors: list[tuple[str, BaseException]] = []  # (product name, what the client got)
    stop = threading.Event()
    progress = threading.Condition()

    def client(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            name = f"Beban {worker}-{n}"
            sent = time.monotonic()
            try:
                created.append((sent, toko.post_product(name)["id"]))
            except BaseException as exc:  # record and keep going: count every failure
                errors.append((name, exc))
            with progress:
                progress.notify_all()

    def wait_created(count: int) -> None:
        with progress:
            ok = progress.wait_for(lambda: len(created) >= count or len(errors) > 20, 60)
        assert ok, f"only {len(created)} products created, errors: {errors[:3]}"

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_created(40)
        pid = toko.main_pid()
        began = time.monotonic()
        toko.machine.run(["systemctl", "restart", "toko-api.service"], timeout=120)
        toko.wait_serving(old_pid=pid)
        ended = time.monotonic()
        wait_created(len(created) + 40)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    # Every failed request, and whether its product was stored all the same.
    failures = [
        (name, repr(exc), toko.sql("SELECT count(*) FROM products WHERE nama = ?", (name,))[0][0])
        for name, exc in errors
    ]
    assert failures == [], (
        f"requests that failed across the restart (name, error, stored): {failures}"
    )
    # Requests sent while the old process drained and the new one started
    # waited in the socket's queue instead of being refused.
    during = [pid for sent, pid in created if began <= sent <= ended]
    assert during, "no request was sent during the restart"
    stored = {row[0] for row in toko.sql("SELECT id FROM products")}
    assert {pid for _, pid in created} <= stored


def test_kill9_with_jobs_pending_completes_every_email(
    toko: Deployment, smtp_server: SmtpServer
) -> None:
    # An admin points toko at a mail server: a slow one, so jobs are in flight.
    smtp_server.reset()
    smtp_server.set_delay(60)
    with toko.settings_added(f"TOKO_SMTP_URL={smtp_server.url}", restart=True):
        toko.machine.run(["systemctl", "restart", "toko-api.service"], timeout=120)
        toko.wait_serving()
        ids = [toko.post_product(f"Tertunda {i}")["id"] for i in range(20)]
        smtp_server.arrivals.wait_for(lambda items: len(items) >= 1, 60, "a send in flight")
        pending = toko.sql(
            "SELECT count(*) FROM jobs WHERE kind = 'product_email' AND state != 'done'"
        )[0][0]
        assert pending >= 10, pending
        pid, restarts = toko.main_pid(), toko.n_restarts()
        smtp_server.set_delay(0)  # the mail server recovers while toko-api is down
        toko.machine.sh(f"kill -9 {pid}")
        wait_until(lambda: toko.n_restarts() > restarts, 60, "the restart after kill -9")
        toko.wait_serving(old_pid=pid)

        def all_done() -> bool:
            rows = toko.sql(
                "SELECT count(*) FROM jobs WHERE kind = 'product_email' AND state != 'done'"
            )
            return bool(rows[0][0] == 0)

        wait_until(all_done, 240, "every product_email job to be done", step=1)
        assert len(smtp_server.delivered_ids()) >= len(ids)


def test_mail_goes_out_through_the_hosts_own_postfix(toko: Deployment) -> None:
    # Debian's Postfix as installed: "Local only", offering STARTTLS with its
    # self-signed certificate. toko-api must use it, not refuse it.
    install = (
        "echo 'postfix postfix/main_mailer_type select Local only' | debconf-set-selections"
        " && export DEBIAN_FRONTEND=noninteractive"
        " && { apt-get install -y -q postfix"
        " || { apt-get update -q && apt-get install -y -q postfix; }; }"
    )
    toko.machine.sh(install, timeout=600)
    assert toko.machine.run(["postconf", "-h", "smtpd_tls_security_level"]).stdout.strip() == "may"
    # Two admins, as a shop with two owners writes it: both get the one email.
    admins = "TOKO_ADMIN_EMAIL=root@localhost, toko@localhost"
    with toko.settings_added("TOKO_SMTP_URL=smtp://127.0.0.1", admins, restart=True):
        toko.machine.run(["systemctl", "restart", "toko-api.service"], timeout=120)
        toko.wait_serving()
        product = toko.post_product("Lewat Postfix")

        def delivered(user: str) -> Callable[[], str | None]:
            def in_mailbox() -> str | None:
                mbox = toko.machine.run(["cat", f"/var/mail/{user}"], check=False).stdout
                return next((m for m in mbox.split("\nFrom ") if "Lewat Postfix" in m), None)

            return in_mailbox

        mail = wait_until(delivered("root"), 60, "the email in root's mailbox", step=0.5)
        assert "Subject: Produk baru: Lewat Postfix" in mail, mail[:2000]
        # Postfix stamps a session that came over TLS "with ESMTPS".
        assert "with ESMTPS id" in mail, mail[:2000]
        copy = wait_until(delivered("toko"), 30, "the email in toko's mailbox", step=0.5)
        message_id = re.compile(r"^Message-I[Dd]: (.+)$", re.MULTILINE)
        sent_once = message_id.findall(mail)
        assert len(sent_once) == 1, mail[:2000]
        assert message_id.findall(copy) == sent_once, copy[:2000]
        jobs = toko.sql(
            "SELECT state FROM jobs WHERE json_extract(payload, '$.product_id') = ?",
            (product["id"],),
        )
        assert jobs == [("done",)], jobs


def test_mail_to_a_provider_logs_in_with_the_credential_over_checked_tls(
    toko: Deployment,
) -> None:
    # The docs' recipe for a provider: a user in TOKO_SMTP_URL, the password
    # as a systemd credential, the provider's CA in the system's store.
    ca = trustme.CA()
    tls = server_tls(ca)
    password = "provider-" + secrets.token_hex(8)
    anchor = "/usr/local/share/ca-certificates/toko-test-provider.crt"
    drop_in = f"{DROP_IN_DIR}/smtp-password.conf"
    with (
        SmtpServer(tls=tls, account=("toko", password)) as provider,
        toko.settings_added(
            f"TOKO_SMTP_URL={provider.url}", "TOKO_ADMIN_EMAIL=owner@shop.test", restart=True
        ),
    ):
        toko.machine.write(anchor, ca.cert_pem.bytes().decode())
        toko.machine.run(["update-ca-certificates"])
        toko.machine.write("/etc/toko/smtp-password", password + "\n", mode=0o600)
        toko.machine.write(
            drop_in, "[Service]\nLoadCredential=smtp-password:/etc/toko/smtp-password\n"
        )
        try:
            toko.machine.run(["systemctl", "daemon-reload"])
            toko.machine.run(["systemctl", "restart", "toko-api.service"], timeout=120)
            toko.wait_serving()
            toko.post_product("Lewat penyedia")
            provider.wait_delivered(1, timeout=60)
            (message,) = provider.delivered()
            assert message.tls and message.login == "toko", message
            assert message.to == ("owner@shop.test",)
            assert [(a.accepted, a.tls) for a in provider.logins.snapshot()] == [(True, True)]
            journal = toko.machine.run(["journalctl", "-o", "json", "--no-pager"]).stdout
            assert password not in journal
        finally:
            toko.machine.run(["rm", "-f", anchor, drop_in, "/etc/toko/smtp-password"])
            toko.machine.run(["update-ca-certificates", "--fresh"])
            toko.machine.run(["systemctl", "daemon-reload"])


# The README and the pages of docs/ it leads to (shipped in /usr/share/doc/toko).
DOCS = (REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")))
# A bare server has no sudo; the admin's root shell needs none.
NO_SUDO = 'sudo() { "$@"; }\n'


def failed_transient_units(toko: Deployment) -> str:
    """The failed units systemd-run left behind (run-u….service), one a line."""
    argv = ["systemctl", "list-units", "--failed", "--plain", "--no-legend", "run-*"]
    return toko.machine.run(argv).stdout.strip()


def doc_block(marker: str) -> str:
    """The docs' first ```sh block containing ``marker`` (the README's first,
    then docs/ by name), as an admin pastes it."""
    for page in DOCS:
        blocks = re.findall(r"^```sh\n(.*?)^```$", page.read_text(), re.S | re.M)
        found = next((block for block in blocks if marker in block), None)
        if found is not None:
            return found
    raise LookupError(f"no sh block with {marker!r} in the README or docs/")


def test_postgres_with_the_readmes_credential_for_every_service(toko: Deployment) -> None:
    # The docs' steps for several hosts, on a real PostgreSQL on the host's
    # 127.0.0.1 (which the container shares). The credential loop used to miss
    # toko-alert@, so no alert could be queued ("password authentication
    # failed"), and `sudo -u toko toko-queue` cannot read the password file.
    cluster = acquire_cluster()
    url = cluster.create_database("systest")
    units = ("toko-api", "toko-recap", "toko-backup", "toko-alert@")
    drop_ins = [f"/etc/systemd/system/{unit}.service.d/db-password.conf" for unit in units]
    try:
        with toko.settings_added(f"TOKO_DATABASE={url}", restart=True):
            try:
                since = toko.now()
                setup = doc_block("LoadCredential=db-password:").replace(
                    "'the password'", shlex.quote(cluster.password)
                )
                toko.machine.run(["bash", "-c", NO_SUDO + setup], timeout=300)
                toko.wait_serving()
                product = toko.post_product("Di PostgreSQL")
                query = "SELECT nama FROM products WHERE id = $1"
                assert fetch_sync(cluster, url, query, product["id"]) == [("Di PostgreSQL",)]
                alert = toko.machine.run(
                    ["systemctl", "start", "toko-alert@test.service"], check=False
                )
                assert alert.returncode == 0, "\n".join(
                    toko.messages("toko-alert@test.service", since)
                )
                query = "SELECT count(*) FROM jobs WHERE kind = 'alert_email'"
                assert fetch_sync(cluster, url, query)[0][0] >= 1

                def mailed() -> list[str]:
                    return [
                        str(e["SUBJECT"])
                        for e in toko.journal("toko-api", since)
                        if e.get("MESSAGE") == "email logged"
                        and e.get("SUBJECT") == "toko: test failed"
                    ]

                wait_until(mailed, 60, "the alert email (log mailer) from toko-api on PostgreSQL")

                # toko-queue: as toko without the password, the hint; its
                # command and the docs' helper log in.
                refused = toko.machine.run(
                    ["runuser", "-u", "toko", "--", "toko-queue", "stats"],
                    check=False,
                )
                assert refused.returncode == 1, refused
                assert PG_HINT in refused.stderr, refused.stderr
                hinted = PG_HINT.split("e.g. ", 1)[1]
                assert "alert_email" in toko.machine.sh(NO_SUDO + hinted).stdout
                # The hint's way with a command that fails leaves no failed
                # unit behind (the system would be "degraded").
                failing = hinted.replace(" stats", " show 999999")
                shown = toko.machine.sh(NO_SUDO + failing, check=False)
                assert shown.returncode == 1 and "no job with id 999999" in shown.stderr, shown
                assert failed_transient_units(toko) == ""
                # The helper's block, not the one of `sudo -u toko toko-queue stats`.
                helper = doc_block("}\ntoko toko-queue stats")
                listed = toko.machine.run(["bash", "-c", NO_SUDO + helper]).stdout
                assert "alert_email" in listed, listed
            finally:
                toko.machine.run(["rm", "-f", "/etc/toko/db-password", *drop_ins])
                toko.machine.run(["systemctl", "daemon-reload"])
                toko.machine.run(
                    ["systemctl", "reset-failed", "toko-alert@test.service"], check=False
                )
    finally:
        asyncio.run(cluster.async_drop_database(url))
        release_cluster()


def test_reconfigure_replaces_an_empty_token_and_writes_it_to_disk(
    toko: Deployment, tmp_path: Path
) -> None:
    # A power cut soon after the first install could leave the token file
    # empty (written, never synced). toko-api refuses an empty token, so the
    # postinst must not keep one: it writes a new token, synced before it gets
    # its name, and the name synced after. `dpkg-reconfigure toko` runs it as
    # an upgrade does. (toko.env is dpkg's: unpacked and synced by dpkg.)
    toko.machine.run(["truncate", "-s", "0", TOKEN_FILE])
    pid = toko.main_pid()
    run = asyncio.run(
        trace_command(
            toko.machine.command(["dpkg-reconfigure", "toko"]),
            tmp_path / "reconfigure.trace",
            [*SYNCS, "rename", "renameat", "renameat2"],
            env={"PATH": os.environ["PATH"]},
            timeout=600,
        )
    )
    assert run.returncode == 0, run.output[-3000:]
    assert f"writing a new API token to {TOKEN_FILE}" in run.output, run.output[-3000:]
    toko.wait_serving(old_pid=pid)
    stat = toko.machine.run(["stat", "-c", "%a %U", TOKEN_FILE]).stdout.split()
    assert stat == ["600", "root"]
    assert toko.read_token()
    assert toko.post_product("Token setelah listrik padam")["id"] > 0

    calls = run.calls
    token, folder = Path(TOKEN_FILE + ".new"), Path(TOKEN_FILE).parent
    in_folder = numbered(calls, where(calls, lambda c: str(folder) in c.args))
    renamed = where(calls, lambda c: f'"{token}"' in c.args and c.succeeded)
    assert len(renamed) == 1, in_folder
    assert [i for i in synced(calls, token) if i < renamed[0]], in_folder
    assert [i for i in synced(calls, folder) if i > renamed[0]], in_folder


def test_stop_drains_and_succeeds(toko: Deployment) -> None:
    toko.post_product("Sebelum berhenti")
    since = toko.now()
    started = time.monotonic()
    toko.machine.run(["systemctl", "stop", "toko-api.service"], timeout=120)
    assert time.monotonic() - started < 30
    assert toko.show("toko-api.service", "Result") == "success"
    assert toko.show("toko-api.service", "ExecMainStatus") == "0"
    messages = toko.messages("toko-api", since)
    assert any(m.startswith("draining") for m in messages), messages
    assert any(m.startswith("stopped") for m in messages), messages


def test_make_as_a_user_without_sudo_says_what_root_must_install(toko: Deployment) -> None:
    # `make run` as a user on a Debian installed with a root password (no
    # sudo) ended in "sudo: not found" when a build package was missing.
    assert toko.machine.sh("command -v sudo", check=False).returncode != 0
    installed = "dpkg-query -W -f='${Status}' strace | grep -q 'install ok installed'"
    assert toko.machine.sh(installed, check=False).returncode != 0
    # The script as a developer's checkout has it (the package does not ship
    # it), where the user can read it: in the booted machine's /tmp.
    script = "/tmp/ensure-apt.sh"
    toko.machine.run(
        ["sh", "-c", f"cat > {script} && chmod 0755 {script}"],
        input=(REPO / "scripts" / "ensure-apt.sh").read_text(),
    )
    proc = toko.machine.run(
        ["runuser", "-u", "nobody", "--", script, "make", "strace"], check=False
    )
    assert proc.returncode == 1, proc
    assert proc.stdout == ""
    assert proc.stderr == (
        "missing Debian packages: strace; without sudo, install them as root"
        " (su -, then: apt-get install strace) and run make again\n"
    )
