"""Plain-text tables for toko-queue: aligned columns, no colours, no dependencies."""

from __future__ import annotations

import json
from collections.abc import Sequence

from service.models import JOB_STATES, iso_utc, printable_text
from service.store.admin import JobDetails, QueueStats

ERROR_WIDTH = 60


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(header), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _short(text: str | None, width: int = ERROR_WIDTH) -> str:
    if not text:
        return "-"
    line = " ".join(printable_text(text).split())
    return line if len(line) <= width else line[: width - 1] + "…"


def stats_text(stats: QueueStats, now: float) -> str:
    counts = stats.counts.to_json()
    parts = [table(["STATE", "JOBS"], [(state, counts[state]) for state in JOB_STATES])]
    if stats.by_kind:
        rows = [
            (kind, *(by_state[s] for s in JOB_STATES)) for kind, by_state in stats.by_kind.items()
        ]
        parts.append(table(["KIND", *(s.upper() for s in JOB_STATES)], rows))
    if stats.oldest_pending_run_at is not None:
        ago = now - stats.oldest_pending_run_at
        when = f"{ago:.1f}s ago" if ago >= 0 else f"in {-ago:.1f}s"
        parts.append(f"oldest pending job due {when}")
    return "\n\n".join(parts)


def jobs_text(jobs: Sequence[JobDetails]) -> str:
    if not jobs:
        return "no jobs"
    rows = [
        (
            d.job.id,
            d.job.kind,
            d.job.state,
            f"{d.job.attempts}/{d.job.max_attempts}",
            iso_utc(d.updated_at),
            # When a pending job runs (next): a waiting one's next attempt.
            iso_utc(d.job.run_at) if d.job.state == "pending" else "-",
            _short(d.job.last_error),
        )
        for d in jobs
    ]
    return table(["ID", "KIND", "STATE", "ATTEMPTS", "UPDATED", "DUE", "LAST ERROR"], rows)


def job_text(details: JobDetails) -> str:
    data = details.to_json()
    payload = json.dumps(data.pop("payload"), ensure_ascii=False, indent=2)
    # Stored before errors were made printable, or by another toko: escape it here too.
    data["last_error"] = printable_text(data["last_error"] or "-")
    data["lease_until"] = data["lease_until"] or "-"
    width = max(len(k) for k in data)
    lines = [f"{key.ljust(width)}  {value}" for key, value in data.items()]
    return "\n".join([*lines, f"{'payload'.ljust(width)}  {payload}"])
