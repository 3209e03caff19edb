from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from service.store.sqlite import SqliteStore


class FakeClock:
    """A settable clock: the only thing these tests mock."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def store(tmp_path: Path, clock: FakeClock) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(str(tmp_path / "toko.db"), clock=clock)
    await s.open()
    yield s
    await s.close()
