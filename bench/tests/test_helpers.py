"""The bench's pure helpers: wrk output parsing and the percentile function."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.loadgen import Sample, per_second
from bench.scenario_backlog import payload_product_id
from bench.sink import read_record
from bench.stats import fmt_spread, median, percentile, spread
from bench.toko import group_commit_factor
from bench.wrk import WrkParseError, duration_to_ms, parse_wrk_output

WRK_TEXT = """\
Running 10s test @ http://127.0.0.1:8080/produk
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.21ms    1.02ms  20.11ms   90.00%
    Req/Sec     5.01k   300.00     5.50k    70.00%
  Latency Distribution
     50%  812.00us
     75%    3.50ms
     90%    4.00ms
     99%    1.20s
  50123 requests in 10.00s, 9.00MB read
  Socket errors: connect 1, read 2, write 3, timeout 4
  Non-2xx or 3xx responses: 12
Requests/sec:   5012.30
Transfer/sec:      0.90MB
"""

WRK_JSON_LINE = (
    'WRK_JSON {"requests": 20000, "duration_us": 10000000, "bytes": 123, '
    '"errors": {"connect": 0, "read": 0, "write": 0, "status": 5, "timeout": 1}, '
    '"latency_us": {"min": 500, "max": 90000, "mean": 3000.5, "stdev": 10.0, '
    '"p50": 2500, "p75": 3000, "p90": 4000, "p99": 12000, "p999": 50000}}'
)


def test_parse_text_report() -> None:
    r = parse_wrk_output(WRK_TEXT)
    assert r.requests == 50123
    assert r.duration_s == pytest.approx(10.0)
    assert r.rps == pytest.approx(5012.30)
    assert r.latency_ms == {
        "p50": pytest.approx(0.812),
        "p75": pytest.approx(3.5),
        "p90": pytest.approx(4.0),
        "p99": pytest.approx(1200.0),
    }
    assert r.errors == {"connect": 1, "read": 2, "write": 3, "timeout": 4, "status": 12}
    assert r.error_count == 22


def test_text_report_without_errors_has_zero_errors() -> None:
    text = "\n".join(
        line for line in WRK_TEXT.splitlines() if "errors" not in line and "Non-2xx" not in line
    )
    assert parse_wrk_output(text).error_count == 0


def test_json_line_wins_over_text() -> None:
    r = parse_wrk_output(WRK_TEXT + WRK_JSON_LINE + "\n")
    assert r.requests == 20000
    assert r.rps == pytest.approx(2000.0)
    assert r.latency_ms["p50"] == pytest.approx(2.5)
    assert r.latency_ms["p99"] == pytest.approx(12.0)
    assert r.latency_ms["p999"] == pytest.approx(50.0)
    assert r.errors["status"] == 5
    assert r.error_count == 6
    assert r.to_json()["error_count"] == 6


def test_text_without_latency_distribution_is_an_error() -> None:
    text = "\n".join(line for line in WRK_TEXT.splitlines() if "%" not in line)
    with pytest.raises(WrkParseError, match="--latency"):
        parse_wrk_output(text)


def test_empty_output_is_an_error() -> None:
    with pytest.raises(WrkParseError):
        parse_wrk_output("unable to connect to 127.0.0.1:8080 Connection refused\n")


@pytest.mark.parametrize(
    ("text", "ms"),
    [("812.00us", 0.812), ("3.21ms", 3.21), ("1.02s", 1020.0), ("2.00m", 120_000.0), ("1h", 3.6e6)],
)
def test_duration_units(text: str, ms: float) -> None:
    assert duration_to_ms(text) == pytest.approx(ms)


def test_bad_duration() -> None:
    with pytest.raises(WrkParseError):
        duration_to_ms("fast")


def test_percentile_interpolates_like_numpy_linear() -> None:
    values = [10.0, 1.0, 4.0, 2.0, 3.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 25) == 2.0
    # rank 0.9 * 4 = 3.6 -> 4 + 0.6 * (10 - 4)
    assert percentile(values, 90) == pytest.approx(7.6)
    assert percentile([5.0], 99) == 5.0


def test_percentile_of_1_to_100() -> None:
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 99) == pytest.approx(99.01)
    assert median(values) == pytest.approx(50.5)


@pytest.mark.parametrize("pct", [-1.0, 100.5, math.nan])
def test_percentile_rejects_bad_pct(pct: float) -> None:
    with pytest.raises(ValueError):
        percentile([1.0, 2.0], pct)


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)


def test_spread_and_format() -> None:
    s = spread([3.0, 1.0, 2.0])
    assert s == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert fmt_spread(s, "{:.1f}", " ms") == "2.0 ms (1.0-3.0)"
    assert fmt_spread(spread([7.0])) == "7"


def test_per_second_buckets_by_scheduled_time() -> None:
    samples = [
        Sample(0, 0.0, started=0.0, finished=0.002, status=201, product_id=1),
        Sample(1, 0.5, started=0.5, finished=0.51, status=201, product_id=2),
        Sample(2, 1.2, started=1.2, finished=1.3, status=201, product_id=3),
    ]
    buckets = per_second(samples)
    assert [b["second"] for b in buckets] == [0, 1]
    assert buckets[0]["n"] == 2
    assert buckets[0]["max_ms"] == pytest.approx(10.0)
    assert buckets[1]["p50_ms"] == pytest.approx(100.0)
    assert samples[2].latency_ms == pytest.approx(100.0)


def test_group_commit_factor_from_store_closed_line(tmp_path: Path) -> None:
    log = tmp_path / "toko.log"
    log.write_text(
        '{"message": "ready"}\n'
        '{"message": "store closed", "COMMITS": 200, "WRITES": 1000}\n'
        '{"message": "stopped"}\n'
    )
    assert group_commit_factor(log) == {"commits": 200, "writes": 1000, "writes_per_commit": 5.0}
    log.write_text('{"message": "stopped"}\n')
    assert group_commit_factor(log) is None
    assert group_commit_factor(tmp_path / "missing.log") is None


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ('{"product_id": 7, "nama": "x"}', 7),
        ('{"product_id": true}', None),
        ("[1, 2]", None),
        ("not json", None),
        (None, None),
    ],
)
def test_product_id_from_job_payload(payload: str | None, expected: int | None) -> None:
    assert payload_product_id(payload) == expected


def test_read_record_skips_torn_lines(tmp_path: Path) -> None:
    record = tmp_path / "msgs.tsv"
    record.write_text("1.5\t<job-1@x>\tdelivered\n2.5\t<job-2@x>\tdelivered\n3.0\t<job-")
    assert read_record(record) == [(1.5, "<job-1@x>", "delivered"), (2.5, "<job-2@x>", "delivered")]
    assert read_record(tmp_path / "missing.tsv") == []


def test_compare_pairs_summary_figures_and_skips_settings_and_samples() -> None:
    from bench.compare import compare

    def run(rps: float, p99: float) -> dict[str, object]:
        return {
            "meta": {"started": "x", "git": "y", "loadavg_before": [1.0, 1.0, 1.0]},
            "throughput": {
                "config": {"duration_s": 10.0},
                "rounds": [{"toko": {"rps": rps}}],
                "summary": {"toko": {"rps": {"median": rps, "min": 1, "max": 9, "n": 3}}},
            },
            "queue": {"figures": {"toko-sqlite": {"latency_p99_ms": p99}}, "met": True},
        }

    rows = compare(run(100.0, 2.0), run(150.0, 3.0))
    assert rows == [
        ("throughput.summary.toko.rps", "100", "150", "1.50"),
        ("queue.figures.toko-sqlite.latency_p99_ms", "2", "3", "1.50"),
    ]
    assert compare(run(100.0, 2.0), run(150.0, 3.0), match="queue") == [rows[1]]
