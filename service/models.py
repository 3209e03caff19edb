"""Plain data shared by the store, the queue and the HTTP layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

JobState = Literal["pending", "running", "done", "failed"]
JOB_STATES: tuple[JobState, ...] = ("pending", "running", "done", "failed")


def iso_utc(epoch: float) -> str:
    """Seconds since the epoch as ISO-8601 UTC with milliseconds, e.g. 2026-11-29T18:00:00.123Z."""
    return (
        datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


@dataclass(frozen=True)
class Product:
    id: int
    nama: str
    harga: int
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "nama": self.nama,
            "harga": self.harga,
            "created_at": iso_utc(self.created_at),
        }


@dataclass(frozen=True)
class NewJob:
    """A job to enqueue; ``payload`` must be JSON-serialisable."""

    kind: str
    payload: dict[str, Any] = field(default_factory=dict)
    max_attempts: int = 5


@dataclass(frozen=True)
class Job:
    id: int
    kind: str
    payload: dict[str, Any]
    state: JobState
    attempts: int
    max_attempts: int
    run_at: float
    last_error: str | None = None


@dataclass(frozen=True)
class QueueCounts:
    pending: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0

    def to_json(self) -> dict[str, int]:
        return {
            "pending": self.pending,
            "running": self.running,
            "failed": self.failed,
            "done": self.done,
        }
