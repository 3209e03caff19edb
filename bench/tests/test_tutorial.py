"""The tutorial scenario's pure parts: binning, result shaping, log parsing, the plot.

Nothing here starts Go, toko-api or a network server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.loadgen import OpenLoopResult, Sample
from bench.scenario_tutorial import (
    GO,
    LABELS,
    TOKO,
    columns,
    figures,
    go_durability,
    outcome,
    parse_go_log,
    per_second_bins,
    report_rows,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _sample(
    i: int,
    scheduled: float,
    latency_s: float,
    *,
    status: int = 201,
    error: str = "",
    finished: bool = True,
) -> Sample:
    s = Sample(i, scheduled, started=scheduled + 0.0001)
    if finished:
        s.finished = scheduled + latency_s
    s.status = status
    s.error = error
    s.product_id = i + 1 if status == 201 and not error else None
    return s


def test_outcome_tells_success_timeout_and_error_apart() -> None:
    assert outcome(_sample(0, 0.0, 0.002)) == "o"
    assert outcome(_sample(1, 0.0, 3.0, status=0, error="TimeoutError")) == "t"
    assert outcome(_sample(2, 0.0, 3.0, status=0, error="ConnectionTimeoutError")) == "t"
    assert outcome(_sample(3, 0.0, 0.0, status=0, error="not completed", finished=False)) == "t"
    assert outcome(_sample(4, 0.0, 0.001, status=0, error="ClientOSError")) == "e"
    assert outcome(_sample(5, 0.0, 0.001, status=500)) == "e"


def test_columns_count_an_unfinished_request_at_the_timeout() -> None:
    samples = [
        _sample(0, 0.0, 0.0015),
        _sample(1, 0.5, 0.0, status=0, error="not completed", finished=False),
    ]
    cols = columns(samples, timeout_s=10.0)
    assert cols["t_s"] == [0.0, 0.5]
    assert cols["latency_ms"] == [1.5, 10000.0]
    assert cols["outcome"] == "ot"


def test_per_second_bins_split_by_scheduled_time_and_count_outcomes() -> None:
    t = [0.0, 0.2, 0.9, 1.0, 1.5, 3.2]
    lat = [1.0, 2.0, 3.0, 10000.0, 10000.0, 5.0]
    bins = per_second_bins(t, lat, "oooteo")
    assert [b["t_s"] for b in bins] == [0.0, 1.0, 3.0]  # empty seconds are left out
    first, second, fourth = bins
    assert (first["n"], first["p50_ms"], first["max_ms"]) == (3, 2.0, 3.0)
    assert (first["ok"], first["timeouts"], first["errors"]) == (3, 0, 0)
    assert (second["n"], second["timeouts"], second["errors"], second["ok"]) == (2, 1, 1, 0)
    assert second["p50_ms"] == 10000.0
    assert fourth["n"] == 1 and fourth["p99_ms"] == 5.0


def test_per_second_bins_with_wider_buckets_and_bad_input() -> None:
    bins = per_second_bins([0.1, 1.9, 2.1], [1.0, 3.0, 5.0], "ooo", width_s=2.0)
    assert [(b["t_s"], b["n"]) for b in bins] == [(0.0, 2), (2.0, 1)]
    with pytest.raises(ValueError):
        per_second_bins([0.0], [1.0, 2.0], "o")


def _load(samples: list[Sample], rate: float, duration: float) -> OpenLoopResult:
    return OpenLoopResult(rate=rate, duration_s=duration, samples=samples, wall_s=duration + 1)


def test_figures_shape_a_system_and_survive_json() -> None:
    samples = [_sample(i, i / 10, 0.002) for i in range(15)]
    late = [1.5 + i / 10 for i in range(5)]
    samples += [_sample(15 + i, t, 3.0, status=0, error="TimeoutError") for i, t in enumerate(late)]
    f = figures(_load(samples, 10.0, 2.0), timeout_s=3.0)
    assert (f["requests"], f["ok_201"], f["timeouts"], f["errors"]) == (20, 15, 5, 0)
    assert f["error_kinds"] == {"TimeoutError": 5}
    assert f["ok_per_s"] == 7.5
    assert f["offered_rate"] == pytest.approx(20 / 1.9)
    assert f["latency_ms"]["max"] == pytest.approx(3000.0)
    assert f["latency_ms"]["p50"] == pytest.approx(2.0)
    assert len(f["requests_detail"]["outcome"]) == 20
    assert [b["n"] for b in f["per_second"]] == [10, 10]
    json.dumps(f)  # the results file is JSON


def test_parse_go_log_counts_emails_per_request_and_panics() -> None:
    lines = [
        {"msg": "server jalan", "addr": "127.0.0.1:1"},
        {"msg": "worker ambil job", "worker": 1, "tujuan": "admin@toko.com"},
        {"msg": "email terkirim", "tujuan": "admin@toko.com", "isi": "Produk baru: bench-tg-7-0"},
        {"msg": "email terkirim", "tujuan": "admin@toko.com", "isi": "Produk baru: bench-tg-7-12"},
        # another run's product: counted as an email, not matched to a request
        {"msg": "email terkirim", "tujuan": "admin@toko.com", "isi": "Produk baru: bench-old-3"},
        {"msg": "http: panic serving 127.0.0.1:5: send on closed channel\ngoroutine 1"},
        {"msg": "semua worker selesai, aplikasi berhenti"},
    ]
    text = "\n".join(json.dumps(x) for x in lines)
    text += "\n2026/01/01 00:00:00 http: panic serving 127.0.0.1:6: boom\n{torn"
    log = parse_go_log(text, "tg-7")
    assert log["emailed_indexes"] == {0, 12}
    assert log["emails_sent"] == 3
    assert log["jobs_taken"] == 1
    assert (log["handler_panics"], log["send_on_closed_channel"]) == (2, 1)
    assert log["clean_exit_logged"] is True
    d = go_durability({0, 1, 2}, log)
    assert (d["ok_201"], d["ok_201_emailed"], d["ok_201_lost"]) == (3, 1, 2)
    assert d["emailed_after_client_gave_up"] == 1  # request 12: emailed, client timed out
    assert "emailed_indexes" not in d


def synthetic_result() -> dict[str, Any]:
    """A small result of the shape run() returns: toko fast, the Go program timing out."""
    toko = [_sample(i, i / 50, 0.002 + (i % 7) / 1000) for i in range(100)]
    go = [_sample(i, i / 50, 0.0008) for i in range(10)]
    go += [_sample(i, i / 50, 1.0, status=0, error="TimeoutError") for i in range(10, 95)]
    go += [_sample(i, i / 50, 0.001, status=0, error="ClientOSError") for i in range(95, 100)]
    systems: dict[str, Any] = {}
    for key, samples in ((TOKO, toko), (GO, go)):
        f = figures(_load(samples, 50.0, 2.0), timeout_s=1.0)
        f["stop"] = {"exit_code": 0, "seconds": 1.2, "killed": key == GO, "timeout_s": 90.0}
        systems[key] = f
    systems[TOKO]["durability"] = {
        "ok_201": 100,
        "products_in_db": 100,
        "emails_sent_during_load": 3,
        "unsent_kept_for_next_start": 97,
        "all_kept": True,
    }
    systems[GO]["durability"] = {
        "ok_201": 10,
        "ok_201_emailed": 4,
        "emails_sent_during_load": 3,
        "send_on_closed_channel": 2,
    }
    return {
        "config": {
            "rate": 50.0,
            "duration_s": 2.0,
            "request_timeout_s": 1.0,
            "email_delay_s": 2.0,
            "workers": 3,
        },
        "labels": dict(LABELS),
        "systems": systems,
    }


def test_report_rows_have_four_columns_and_the_key_figures() -> None:
    rows = report_rows(synthetic_result())
    assert rows and all(len(r) == 4 and all(isinstance(c, str) for c in r) for r in rows)
    text = "\n".join(" | ".join(r) for r in rows)
    assert "100/100 · 0 · 0" in text  # toko: every request a 201
    assert "10/100 · 85 · 5" in text  # Go: 201s · timeouts · other errors
    assert "100/100 with one job each" in text and "all kept ✅" in text
    assert "4/10" in text and "killed after 1 s" in text


def test_write_plot_writes_a_png(tmp_path: Path) -> None:
    from bench.plot import write_plot

    path = tmp_path / "docs" / "tutorial-latency.png"
    write_plot(synthetic_result(), path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000  # a real picture, not an empty canvas
