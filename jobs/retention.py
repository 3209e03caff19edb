"""Retention: done jobs older than TOKO_JOB_RETENTION are deleted (run by toko-recap).

Failed and pending jobs are never pruned: they still need an admin or a worker.
"""

from __future__ import annotations

import logging

from service.durations import format_duration
from service.models import iso_utc
from service.store.roles import QueueAdmin

log = logging.getLogger("toko.retention")


async def prune_done_jobs(admin: QueueAdmin, retention: float, now: float) -> int:
    cutoff = now - retention
    pruned = await admin.purge_done(cutoff)
    log.info(
        "done jobs pruned",
        extra={
            "PRUNED": pruned,
            "RETENTION": format_duration(retention),
            "OLDER_THAN": iso_utc(cutoff),
        },
    )
    return pruned
