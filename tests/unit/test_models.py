from __future__ import annotations

import random
from datetime import UTC, datetime

from service.models import iso_utc


def test_iso_utc_matches_datetime_formatting() -> None:
    rng = random.Random(42)
    samples = [0.0, 1.9999999, 1_795_977_530.9999996] + [rng.uniform(0, 4e9) for _ in range(20_000)]
    for epoch in samples:
        expected = datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")
        assert iso_utc(epoch) == expected.replace("+00:00", "Z"), epoch
