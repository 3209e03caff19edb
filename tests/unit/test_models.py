from __future__ import annotations

import random
from datetime import UTC, datetime

from service.models import iso_utc, printable_text


def test_iso_utc_matches_datetime_formatting() -> None:
    rng = random.Random(42)
    samples = [0.0, 1.9999999, 1_795_977_530.9999996, -0.5, -8_640_000_000.229]
    # Before 1970 too: toko-queue purge --done-older-than 100000d prints such a cut.
    samples += [rng.uniform(-1e10, 4e9) for _ in range(20_000)]
    for epoch in samples:
        expected = datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")
        assert iso_utc(epoch) == expected.replace("+00:00", "Z"), epoch


def test_printable_text_escapes_what_a_store_or_terminal_cannot_take() -> None:
    # A Latin-1 reply from a mail server, as aiosmtplib decodes it.
    assert printable_text("550 Empf\udce4nger unbekannt") == "550 Empf\\xe4nger unbekannt"
    # Terminal escapes (set the title, clear the screen) and a C1 control.
    assert printable_text("a\x1b]0;x\x07\x1b[2J\x9bb") == "a\\x1b]0;x\\x07\\x1b[2J\\x9bb"
    # A lone surrogate that stands for no byte.
    assert printable_text("\ud800") == "\\ud800"
    # What is fine stays as it is: other scripts, tabs and line breaks.
    text = "Kopi Susu ☕ — ok\n\tnext line"
    assert printable_text(text) == text
    for sample in ("550 Empf\udce4nger", "\x00\ud800\x9b"):
        printable_text(sample).encode("utf-8")  # storable: never raises
