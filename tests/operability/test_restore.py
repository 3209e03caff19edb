"""After a restore from backup, new emails are new to the admin's mailbox.

A restore brings back a database from before some jobs existed, so their ids
are handed out again. A mailbox that has seen a Message-ID before may drop or
merge a second message with it, without any error: an email's Message-ID must
stay the same across the retries of its job, and differ for a job that merely
has the same id. The runs here are the real toko-api, toko-backup and SMTP
server, restored the way the README says (toko-api stopped first).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import aiohttp

from tests.conftest import ServiceFactory
from tests.operability.cli import run
from tests.support.api import create_products
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpMessage, SmtpServer


async def _delivered(smtp: SmtpServer, count: int) -> list[SmtpMessage]:
    """The first ``count`` emails delivered, in order; Message-IDs alike or not."""

    def enough(items: Sequence[SmtpMessage]) -> list[SmtpMessage] | None:
        delivered = [m for m in items if m.outcome == "delivered"]
        return delivered[:count] if len(delivered) >= count else None

    return await smtp.log.async_wait_for(enough, timeout=20, what=f"{count} delivered emails")


async def _add_product(svc: ServiceProcess, nama: str) -> None:
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, [nama])


async def test_a_job_id_handed_out_again_after_a_restore_gets_a_message_id_of_its_own(
    service_factory: ServiceFactory, smtp: SmtpServer, tmp_path: Path
) -> None:
    env = {"TOKO_SMTP_URL": smtp.url, "TOKO_MAIL_FROM": "kasir@toko.test"}
    tools = {"TOKO_DATABASE": str(tmp_path / "toko.db"), "TOKO_BACKUP_DIR": str(tmp_path / "b")}
    svc = service_factory(env).start()
    await svc.async_wait_ready(timeout=20)
    await _add_product(svc, "Kopi")
    await _delivered(smtp, 1)
    backed_up = await run("toko-backup", env=tools)  # before the next job exists
    assert backed_up.returncode == 0, backed_up.stderr
    await _add_product(svc, "Teh")
    await _delivered(smtp, 2)
    svc.terminate()
    assert await svc.async_wait_exit(timeout=20) == 0

    (backup,) = (tmp_path / "b").glob("toko-*.db")
    restored = await run("toko-backup", "--restore", str(backup), env=tools)
    assert restored.returncode == 0, restored.stderr
    svc = service_factory(env).start()
    await svc.async_wait_ready(timeout=20)
    await _add_product(svc, "Susu")

    _, teh, susu = await _delivered(smtp, 3)
    assert "Teh" in teh.subject and "Susu" in susu.subject
    # The restore gave Teh's job id to Susu's job; not its Message-ID.
    assert teh.headers["X-Toko-Job-Id"] == susu.headers["X-Toko-Job-Id"]
    assert teh.message_id != susu.message_id
    assert smtp.duplicates() == {}
