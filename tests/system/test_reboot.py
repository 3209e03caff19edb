"""Surviving restarts of the whole machine: a clean reboot, a power cut, timers missed while off.

They reboot the session's machine (the same tree, booted again) and leave it
as the other tests expect it: toko installed, running, with its timers.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import date, timedelta
from typing import Any

import pytest

from tests.support.smtp import SmtpMessage, SmtpServer
from tests.system.deployment import Deployment
from tests.system.machine import log, wait_until

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

TIMERS = ("toko-recap.timer", "toko-backup.timer")
STAMPS = "/var/lib/systemd/timers"


@contextlib.contextmanager
def mail_through(toko: Deployment, smtp_server: SmtpServer) -> Iterator[None]:
    """toko-api sending through the host's test SMTP server, with a short backoff.

    The short backoff keeps the retries after the boot within the test's
    time; toko.env as it was afterwards, and toko-api restarted to read it.
    """
    settings = (f"TOKO_SMTP_URL={smtp_server.url}", "TOKO_JOB_BACKOFF=0.2")
    with toko.settings_added(*settings, restart=True):
        toko.machine.run(["systemctl", "restart", "toko-api.service"], timeout=120)
        toko.wait_serving()
        yield


def email_jobs(toko: Deployment, like: str) -> dict[int, tuple[int, str]]:
    """Product id -> (how many product_email jobs it has, the Message-ID of its
    first job), for the products whose name is LIKE ``like``."""
    rows = toko.sql(
        "SELECT p.id, count(j.id), min(j.id), min(j.created_at) FROM products p"
        " LEFT JOIN jobs j ON j.kind = 'product_email'"
        " AND json_extract(j.payload, '$.product_id') = p.id"
        " WHERE p.nama LIKE ? GROUP BY p.id",
        (like,),
    )
    return {
        product: (count, f"<job-{job}.{math.floor(created * 1000)}@")
        for product, count, job, created in rows
    }


def wait_mailed(smtp_server: SmtpServer, message_ids: set[str], timeout: float) -> None:
    """Until a message with each of ``message_ids`` (the part before the domain) is delivered."""

    def delivered(messages: list[SmtpMessage]) -> bool:
        seen = {m.message_id.partition("@")[0] + "@" for m in messages if m.outcome == "delivered"}
        return message_ids <= seen

    what = f"{len(message_ids)} emails delivered"
    smtp_server.log.wait_for(delivered, timeout, what)


def wait_tempfailed(smtp_server: SmtpServer) -> None:
    smtp_server.log.wait_for(
        lambda items: any(m.outcome == "tempfailed" for m in items), 30, "a deferred email"
    )


def assert_up_after_boot(toko: Deployment) -> None:
    """toko-api serves through its socket, started by the boot alone, and the timers are listed."""
    wait_until(lambda: serves(toko), 60, "toko-api to answer on its socket after the boot")
    for unit in ("toko-api.socket", "toko-api.service", *TIMERS):
        assert toko.show(unit, "ActiveState") == "active", unit
    # A run caught up at the boot may still be under way.
    wait_until(lambda: toko.timers_scheduled(*TIMERS), 60, "both timers listed with a next run")


def serves(toko: Deployment) -> bool:
    try:
        return toko.healthz().status == 200
    except OSError:
        return False


def test_clean_reboot_with_emails_pending_delivers_every_one(
    toko: Deployment, smtp_server: SmtpServer
) -> None:
    smtp_server.reset()
    smtp_server.fail_for(3600)  # the mail server defers every message (451)
    with mail_through(toko, smtp_server):
        for i in range(10):
            toko.post_product(f"Sebelum reboot {i}")
        wait_tempfailed(smtp_server)
        jobs = email_jobs(toko, "Sebelum reboot %")
        assert len(jobs) == 10 and {count for count, _ in jobs.values()} == {1}, jobs
        waiting = toko.sql(
            "SELECT count(*) FROM jobs WHERE kind = 'product_email' AND state != 'done'"
        )[0][0]
        assert waiting >= 10, waiting
        # The mail server takes mail again while the machine is down.
        toko.machine.reboot(while_off=smtp_server.reset)
        assert_up_after_boot(toko)
        message_ids = {message_id for _, message_id in jobs.values()}
        assert len(message_ids) == 10
        wait_mailed(smtp_server, message_ids, 60)
        log(f"after the reboot: {len(message_ids)} pending emails delivered")


def test_power_cut_while_posting_loses_no_accepted_product(
    toko: Deployment, smtp_server: SmtpServer
) -> None:
    """Every process of the machine killed at once while POSTs are answered.

    The machine's disk is a directory on the host, whose page cache survives
    the cut: this is a crash of every process (toko-api, systemd, journald)
    in the same instant, not a lost disk cache. A cut that falls between
    requests tests little, so the power is cut again, after the boot, until
    one falls while toko-api answers a request.
    """
    accepted: list[int] = []  # ids of the products a client got a 201 for
    mid_request: list[OSError] = []
    with mail_through(toko, smtp_server):
        for round_ in range(1, 6):
            smtp_server.fail_for(3600)  # emails wait at the cut, to be sent after the boot
            cut_off = power_cut_while_posting(
                toko, f"Listrik padam {round_}", accepted, while_off=smtp_server.reset
            )
            mid_request = [e for e in cut_off if not isinstance(e, ConnectionRefusedError)]
            if mid_request:
                break
            log(f"power cut {round_} fell between requests: {cut_off}")
        assert mid_request, "no power cut fell while a request was answered"
        assert_up_after_boot(toko)
        assert toko.sql("PRAGMA integrity_check") == [("ok",)]
        jobs = email_jobs(toko, "Listrik padam %")
        missing = sorted(set(accepted) - set(jobs))
        assert missing == [], f"products answered 201 but not stored: {missing}"
        not_one = {product: count for product, (count, _) in jobs.items() if count != 1}
        assert not_one == {}, f"products without exactly one email job: {not_one}"
        message_ids = {message_id for _, message_id in jobs.values()}
        wait_mailed(smtp_server, message_ids, 60)
        log(
            f"power cut {round_}: {len(mid_request)} requests cut off while answered,"
            f" {len(accepted)} products answered 201, {len(jobs)} stored,"
            f" {len(message_ids)} emails delivered after the boot"
        )


def power_cut_while_posting(
    toko: Deployment, label: str, accepted: list[int], while_off: Callable[[], None]
) -> list[OSError]:
    """Four clients POST products named ``label …`` until the power is cut the
    instant one of them has sent a request; ``while_off()``, then boot.

    The id of each product answered 201 is added to ``accepted``. Returns how
    each client's last request ended.
    """
    other: list[Any] = []  # any answer but a 201: there must be none
    cut_off: list[OSError] = []
    progress = threading.Condition()
    cut_armed = threading.Event()  # the next request sent cuts the power
    cut_lock = threading.Lock()  # one client only cuts it
    cut = threading.Event()  # the power is cut
    stop = threading.Event()  # the test ended before the cut
    enough = len(accepted) + 40

    def cut_if_armed() -> None:
        # Cut in the sending thread, once its request is sent: a thread woken
        # for it could take longer than toko-api takes to answer.
        with cut_lock:
            if cut_armed.is_set() and not cut.is_set():
                toko.machine.cut_power()
                cut.set()

    def client(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                resp = toko.post(f"{label}-{worker}-{n}", on_sent=cut_if_armed)
            except OSError as exc:  # the machine went down under (or before) the request
                cut_off.append(exc)
                return
            with progress:
                if resp.status == 201:
                    accepted.append(resp.body["id"])
                else:
                    other.append(resp)
                progress.notify_all()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()

    def clients_cut_off() -> None:
        # Each client's next request at the latest is refused: they all end.
        for t in threads:
            t.join(60)
        while_off()

    try:
        with progress:
            assert progress.wait_for(lambda: len(accepted) >= enough or other, 60), other
        cut_armed.set()
        assert cut.wait(30)
        toko.machine.boot_after_cut(while_off=clients_cut_off)
    finally:
        stop.set()
        clients_cut_off()
    assert other == []
    assert len(cut_off) == len(threads), cut_off
    return cut_off


def shown_time(toko: Deployment, prop: str, unit: str = "") -> int:
    """A timestamp property of ``unit`` (or of the manager), in µs since the epoch."""
    return shown_times(toko, unit, prop)[prop]


def shown_times(toko: Deployment, unit: str, *props: str) -> dict[str, int]:
    """Timestamp properties of ``unit`` (or of the manager) read in one call, so
    from one state of the manager (no run of the unit falls between them), in
    µs since the epoch."""
    argv = ["systemctl", "show", *(f"--property={prop}" for prop in props)]
    argv += [unit] if unit else []
    shown = dict(line.split("=", 1) for line in toko.machine.run(argv).stdout.splitlines())
    return {prop: usec_since_epoch(toko, shown[prop]) for prop in props}


def usec_since_epoch(toko: Deployment, text: str) -> int:
    """A timestamp as systemctl shows it, in µs since the epoch."""
    seconds = toko.machine.run(["date", "-d", text.strip(), "+%s"]).stdout
    return int(seconds) * 1_000_000


def timespan_usec(toko: Deployment, span: str) -> int:
    """A unit file's time span (``10min``) in µs, as systemd reads it."""
    out = toko.machine.run(["systemd-analyze", "timespan", span]).stdout
    match = re.search(r"μs: (\d+)", out)
    assert match, out
    return int(match.group(1))


def test_timers_missed_while_off_run_after_the_boot(toko: Deployment) -> None:
    today = date.fromisoformat(toko.machine.run(["date", "+%F"]).stdout.strip())
    days = {n: (today - timedelta(days=n)).isoformat() for n in (1, 2, 3)}
    # The machine was switched off two days ago, after that day's recap (of
    # the day before). Days 2 and 1 were never recapped.
    toko.sql("DELETE FROM recaps WHERE period >= ?", (days[3],))
    toko.sql(
        "INSERT INTO recaps (period, products_total, products_new, created_at) VALUES (?, 0, 0, ?)",
        (days[3], time.time() - 2 * 86400),
    )
    # The shipped delays, read from the installed units: the catch-up of a
    # missed run comes within them after the boot, not at the next calendar time.
    backup_delay = timespan_usec(toko, toko.show("toko-backup.timer", "RandomizedDelayUSec"))
    backup_accuracy = timespan_usec(toko, toko.show("toko-backup.timer", "AccuracyUSec"))
    # The recap's delay of up to 10 minutes (plus a minute's accuracy) is
    # longer than this test may take: a drop-in takes it away, for the recap
    # only, so that its run is seen; the backup keeps the shipped one.
    no_delay = "/etc/systemd/system/toko-recap.timer.d/test-no-delay.conf"
    two_days_ago = time.time() - 2 * 86400

    def off_for_two_days() -> None:
        for timer in TIMERS:
            stamp = toko.machine.root / f"{STAMPS}/stamp-{timer}".lstrip("/")
            stamp.touch()
            os.utime(stamp, (two_days_ago, two_days_ago))
        toko.machine.write(no_delay, "[Timer]\nRandomizedDelaySec=0\nAccuracySec=1us\n")

    try:
        toko.machine.reboot(while_off=off_for_two_days)
        boot = shown_time(toko, "UserspaceTimestamp")
        assert_up_after_boot(toko)

        def recapped() -> list[tuple[Any, ...]] | None:
            rows = toko.sql(
                "SELECT period FROM recaps WHERE period >= ? ORDER BY period", (days[3],)
            )
            return rows if len(rows) == 3 else None

        rows = wait_until(recapped, 60, "the missed recaps")
        assert rows == [(days[3],), (days[2],), (days[1],)]
        # The last row is committed before the run logs it and ends: its
        # result and its journal once it has ended.
        wait_until(
            lambda: toko.show("toko-recap.service", "ActiveState") in ("inactive", "failed"),
            60,
            "the recap's run to end",
        )
        assert toko.show("toko-recap.service", "Result") == "success"
        assert shown_time(toko, "LastTriggerUSec", "toko-recap.timer") >= boot
        recorded = [
            e.get("PERIOD")
            for e in toko.journal("toko-recap", boot / 1e6)
            if e.get("MESSAGE") == "recap recorded"
        ]
        assert recorded == [days[2], days[1]], recorded

        # The backup, with the shipped delay: caught up within it after the
        # boot, not at the next 02:30 (which only a run between 02:00 and 02:30
        # cannot tell). The random delay may be shorter than this test has
        # taken so far: then the catch-up has run, and is the last trigger;
        # otherwise the last trigger is still the stamp's and the catch-up is due.
        times = shown_times(toko, "toko-backup.timer", "LastTriggerUSec", "NextElapseUSecRealtime")
        last, due = times["LastTriggerUSec"], times["NextElapseUSecRealtime"]
        if last >= boot:
            caught_up, how = last, "ran"
        else:
            assert abs(last - two_days_ago * 1e6) < 2e6, (last, two_days_ago)
            caught_up, how = due, "due"
        assert boot <= caught_up <= boot + backup_delay + backup_accuracy, (boot, times)
        log(
            f"missed timers: recaps of {recorded} recorded at the boot;"
            f" backup {how} {(caught_up - boot) / 1e6:.0f} s after it"
        )
    finally:
        toko.machine.run(["rm", "-f", no_delay])
        toko.machine.run(["systemctl", "daemon-reload"])
