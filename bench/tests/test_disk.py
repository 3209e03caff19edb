"""The disk scenario's pure helpers: mounts, windows, targets, the generator's merge and
its raw client's response heads."""

from __future__ import annotations

import os
import struct
import threading
import time

import pytest

from bench import cli
from bench.disk_probes import (
    Tick,
    WalIndex,
    cpu_times,
    descendants,
    filesystem_of,
    parse_wal_index,
    thread_schedstats,
)
from bench.loadgen import Sample
from bench.loadgen_split import merge
from bench.procs import REPO
from bench.rawhttp import parse_head
from bench.scenario_disk import (
    Quiet,
    _commits_text,
    _stalls_by_window,
    cpu_per_request_us,
    evaluate,
    targets_for,
    window_stats,
)
from bench.toko import baseline_target

MOUNTS = """\
proc /proc proc rw,relatime 0 0
/dev/vda / ext4 rw,relatime,discard 0 0
tmpfs /dev/shm tmpfs rw,relatime 0 0
/dev/vdb /srv/data xfs rw 0 0
tmpfs /srv/data/cache tmpfs rw 0 0
/dev/vdc /srv/my\\040disk btrfs rw 0 0
overlay /srv/data overlay rw 0 0
"""


def test_filesystem_is_the_longest_mount_point_that_holds_the_path() -> None:
    assert filesystem_of("/work/main/bench/results", MOUNTS)["fstype"] == "ext4"
    assert filesystem_of("/dev/shm/x.db", MOUNTS) == {
        "mount_point": "/dev/shm",
        "fstype": "tmpfs",
        "device": "tmpfs",
    }
    assert filesystem_of("/srv/data/cache/toko.db", MOUNTS)["fstype"] == "tmpfs"
    # A prefix of a name is not a parent folder.
    assert filesystem_of("/srv/data/cachex/toko.db", MOUNTS)["mount_point"] == "/srv/data"


def test_filesystem_last_mount_on_a_point_wins_and_escapes_are_read() -> None:
    assert filesystem_of("/srv/data/toko.db", MOUNTS)["fstype"] == "overlay"
    assert filesystem_of("/srv/my disk/toko.db", MOUNTS)["fstype"] == "btrfs"
    assert filesystem_of("/srv/data", MOUNTS)["fstype"] == "overlay"


def test_filesystem_unknown_without_mounts() -> None:
    assert filesystem_of("/x", "")["fstype"] == "unknown"


def test_targets_by_position_last_repeats() -> None:
    assert targets_for([1000, 2000], [5, 20]) == [5, 20]
    assert targets_for([200, 400, 800], [5, 20]) == [5, 20, 20]
    assert targets_for([1000], [5, 20]) == [5]
    with pytest.raises(ValueError):
        targets_for([1000], [])


def test_default_targets_follow_the_rate_not_the_position() -> None:
    assert targets_for([1000, 2000], None) == [5, 20]
    assert targets_for([2000], None) == [20]
    assert targets_for([500, 1500, 4000], None) == [5, 20, 20]


def _sample(i: int, scheduled: float, latency_ms: float, late_ms: float = 0.1) -> Sample:
    s = Sample(i, scheduled)
    s.started = scheduled + late_ms / 1000
    s.finished = scheduled + latency_ms / 1000
    s.status = 201
    s.product_id = i
    return s


MIB = 1024 * 1024


def _wal(frames: int, backfilled: int, salt: bytes = b"s1") -> WalIndex:
    return WalIndex(page_size=4096, frames=frames, backfilled=backfilled, salt=salt)


def _tick(at: float, cpu: float, wal_mib: float, wal: WalIndex) -> Tick:
    # Per second: the machine 1.5 s of CPU, toko 0.6, the bench's tree 0.9 (toko included).
    return Tick(at, 1.5 * cpu, 0.6 * cpu, 0.9 * cpu, 0.0, wal_bytes=int(wal_mib * MIB), wal=wal)


def test_windows_group_requests_by_scheduled_time() -> None:
    # 10 requests per second for 10 s; one slow request in the second window,
    # finishing after that window has ended: it still counts for its own.
    samples = [_sample(i, i / 10, 2.0) for i in range(100)]
    samples[60] = _sample(60, 6.0, 150.0, late_ms=3.0)
    failed = Sample(99, 9.9, started=9.9)  # no response at all
    samples[99] = failed
    ticks = [
        _tick(-0.5, 0.0, 0.0, _wal(0, 0)),
        _tick(0.0, 0.5, 1.0, _wal(256, 0)),
        _tick(4.5, 5.0, 3.0, _wal(768, 256)),  # a checkpoint is under way
        # Done and restarted (new salt), 128 frames since: 512 + 0 checkpointed.
        _tick(5.0, 5.5, 3.0, _wal(128, 0, b"s2")),
        _tick(11.0, 11.5, 9.0, _wal(9, 0, b"s3")),  # after the schedule: left out
    ]
    fsync = [(1.0, 1.5), (2.0, 0.5), (7.0, 40.0), (12.0, 99.0)]
    w0, w1 = window_stats(samples, window_s=5, duration_s=10, ticks=ticks, fsync=fsync)
    assert (w0["from_s"], w0["to_s"], w0["requests"], w0["non_201"]) == (0, 5, 50, 0)
    assert w0["p50_ms"] == w0["max_ms"] == 2.0
    assert w0["p99_from_send_ms"] == pytest.approx(1.9)
    assert w0["wal_mib"] == [1.0, 3.0] and w0["wal_max_mib"] == 3.0
    frame = 4096 + 24
    assert w0["wal_in_use_max_mib"] == round((32 + 768 * frame) / MIB, 2)
    assert w0["wal_checkpointed_mib"] == round(256 * frame / MIB, 2)
    assert w0["wal_restarts"] == 0
    assert (w0["cpu_machine_pct"], w0["cpu_toko_pct"]) == (150.0, 60.0)
    assert (w0["cpu_bench_pct"], w0["cpu_others_pct"]) == (30.0, 60.0)
    assert (w0["fsync_n"], w0["fsync_max_ms"], w0["fsync_p50_ms"]) == (2, 1.5, 1.0)
    assert (w1["requests"], w1["non_201"]) == (50, 1)
    assert w1["max_ms"] == 150.0 and w1["p50_ms"] == 2.0
    assert w1["late_max_ms"] == 3.0
    assert w1["wal_mib"] == [3.0] and w1["fsync_max_ms"] == 40.0
    assert w1["wal_restarts"] == 1
    assert w1["wal_checkpointed_mib"] == round(512 * frame / MIB, 2)


def test_windows_without_ticks_have_no_wal_or_cpu_figures() -> None:
    (w,) = window_stats([_sample(0, 0.0, 1.0)], window_s=5, duration_s=5)
    assert "wal_mib" not in w and "cpu_toko_pct" not in w
    assert w["fsync_n"] == 0 and w["fsync_max_ms"] is None


def test_ticks_without_a_wal_give_cpu_only() -> None:
    ticks = [Tick(0.0, 0.0, 0.0, 0.0, 0.0), Tick(1.0, 1.2, 0.5, 0.6, 0.3, 0.05, 0.15)]
    (w,) = window_stats([_sample(0, 0.0, 1.0)], window_s=5, duration_s=5, ticks=ticks)
    assert "wal_mib" not in w
    assert (w["cpu_postgres_pct"], w["cpu_irq_pct"], w["cpu_steal_pct"]) == (30.0, 5.0, 15.0)
    assert w["cpu_others_pct"] == 10.0


def test_cpu_times_keep_interrupts_and_steal_apart() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    line = "cpu  1000 100 500 9000 400 50 150 200 0 0"
    assert cpu_times(line, 100) == (20.0, 2.0, 2.0)
    assert cpu_times("cpu  1 2 3 4", 1) == (6.0, 0.0, 0.0)


def test_a_short_last_window_ends_at_the_duration() -> None:
    windows = window_stats([_sample(0, 0.0, 1.0)], window_s=5, duration_s=12)
    assert [(w["from_s"], w["to_s"]) for w in windows] == [(0, 5), (5, 10), (10, 12)]
    assert windows[2]["requests"] == 0 and windows[2]["p99_ms"] is None


def test_evaluate_names_the_windows_over_target() -> None:
    samples = [_sample(i, i / 100, 1.0) for i in range(1000)]
    for i in range(500, 520):  # 20 of the 500 in window 5-10 s: its p99 is 30 ms
        samples[i] = _sample(i, i / 100, 30.0, late_ms=2.0)
    windows = window_stats(samples, window_s=5, duration_s=10)
    verdict = evaluate(windows, p99_target_ms=5, max_target_ms=100, lateness_limit_ms=1)
    assert verdict["checks"] == {
        "p99_every_window": False,
        "max_within_target": True,
        "all_201": True,
    }
    assert verdict["windows_over_p99_target"] == [5]
    assert verdict["worst_window_p99_ms"] == 30.0
    assert verdict["generator_kept_up"] is False
    relaxed = evaluate(windows, p99_target_ms=50, max_target_ms=20, lateness_limit_ms=5)
    assert relaxed["checks"]["p99_every_window"] and not relaxed["checks"]["max_within_target"]
    assert relaxed["generator_kept_up"]


def test_windows_the_machine_disturbed_are_told_apart_and_still_count() -> None:
    samples = [_sample(i, i / 100, 1.0) for i in range(1500)]
    for i in (*range(500, 520), *range(1000, 1020)):  # windows 5-10 s and 10-15 s miss
        samples[i] = _sample(i, i / 100, 30.0)
    windows = window_stats(samples, window_s=5, duration_s=15)
    windows[0]["cpu_steal_pct"] = 20.0  # disturbed, yet within target
    windows[1]["fsync_held_max_ms"] = 140.0  # the disk stalled for everyone
    verdict = evaluate(windows, p99_target_ms=5, max_target_ms=100, lateness_limit_ms=5)
    assert verdict["windows_over_p99_target"] == [5, 10]
    assert not verdict["checks"]["p99_every_window"]  # the target holds for every window
    assert verdict["disturbed"] == {"0": ["steal"], "5": ["disk"]}
    assert verdict["quiet_windows"] == 1
    assert verdict["quiet_windows_over_p99_target"] == [10]
    calm = evaluate(
        windows,
        p99_target_ms=5,
        max_target_ms=100,
        lateness_limit_ms=5,
        quiet=Quiet(steal_pct=50, probe_ms=200),
    )
    assert calm["quiet_windows"] == 3 and calm["disturbed"] == {}


def test_a_window_with_a_traced_disk_stall_counts_as_disturbed() -> None:
    samples = [_sample(i, i / 100, 1.0) for i in range(1500)]
    for i in (*range(500, 520), *range(1000, 1020)):  # windows 5-10 s and 10-15 s miss
        samples[i] = _sample(i, i / 100, 30.0)
    windows = window_stats(samples, window_s=5, duration_s=15)
    stalls = [
        {"at_s": 5.0, "span_ms": 30.0, "cause": "disk"},  # the probe missed it: a write held 30 ms
        {"at_s": 10.0, "span_ms": 12.0, "cause": "cpu"},
        {"at_s": 12.5, "span_ms": 15.0, "cause": "disk"},
        {"at_s": 12.6, "span_ms": 11.0, "cause": "disk"},
        {"at_s": 15.2, "span_ms": 20.0, "cause": "disk"},  # in the tail, after the last window
    ]
    _stalls_by_window(windows, stalls, 5)
    assert [w["stalls_by_cause"] for w in windows] == [{}, {"disk": 1}, {"cpu": 1, "disk": 2}]
    verdict = evaluate(windows, p99_target_ms=5, max_target_ms=100, lateness_limit_ms=5)
    assert verdict["disturbed"] == {"5": ["disk"], "10": ["disk"]}
    windows[2]["stalls_by_cause"] = {"cpu": 1}  # a wait for a core is toko's to bear: it counts
    verdict = evaluate(windows, p99_target_ms=5, max_target_ms=100, lateness_limit_ms=5)
    assert verdict["quiet_windows_over_p99_target"] == [10]


def test_a_disk_stall_across_a_window_boundary_disturbs_both_windows() -> None:
    """As on 2026-12-07 at 21:18: a write held 492 ms from 14.82 s, the
    requests sent in the next window's first 0.36 s waiting behind it too."""
    samples = [_sample(i, i / 100, 1.0) for i in range(1500)]
    for i in range(1482, 1500):
        samples[i] = _sample(i, i / 100, 400.0)
    samples += [_sample(1500 + i, 15 + i / 100, 300.0) for i in range(36)]
    fsync = [(0.5, 0.4), (14.8, 443.9), (15.3, 0.4)]
    windows = window_stats(samples, window_s=5, duration_s=20, fsync=fsync)
    assert [w["fsync_max_ms"] for w in windows][2:] == [443.9, 0.4]
    assert [w["fsync_held_max_ms"] for w in windows] == [0.4, 0.0, 443.9, 443.9]
    verdict = evaluate(windows, p99_target_ms=5, max_target_ms=100, lateness_limit_ms=5)
    assert verdict["disturbed"] == {"10": ["disk"], "15": ["disk"]}
    # Traced, with the probe well: the stall counts in each window it spans.
    for w in windows:
        w["fsync_held_max_ms"] = 0.4
    stalls = [{"at_s": 14.82, "span_ms": 544.6, "cause": "disk"}]
    _stalls_by_window(windows, stalls, 5)
    assert [w["stalls_by_cause"] for w in windows] == [{}, {}, {"disk": 1}, {"disk": 1}]
    verdict = evaluate(windows, p99_target_ms=5, max_target_ms=100, lateness_limit_ms=5)
    assert verdict["quiet_windows_over_p99_target"] == []


def test_evaluate_an_empty_window_misses() -> None:
    windows = window_stats([_sample(0, 0.0, 1.0)], window_s=5, duration_s=10)
    verdict = evaluate(windows, p99_target_ms=5, max_target_ms=100, lateness_limit_ms=1)
    assert verdict["windows_over_p99_target"] == [5]


def test_merge_restores_schedule_order_across_processes() -> None:
    even = [(i, i / 10, i / 10, i / 10 + 0.001, 201, "", i) for i in range(0, 6, 2)]
    odd = [(i, i / 10, i / 10, i / 10 + 0.002, 503, "", None) for i in range(1, 6, 2)]
    result = merge(10.0, 0.6, 123.0, [(odd, 0.7, 40.0), (even, 0.65, 41.0)])
    assert [s.index for s in result.samples] == list(range(6))
    assert result.wall_s == 0.7 and result.t0_monotonic == 123.0
    summary = result.summary()
    assert (summary["requests"], summary["ok_201"], summary["errors"]) == (6, 3, 3)


def test_parse_head_reads_status_length_and_keep_alive() -> None:
    head = b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\ncontent-length: 57"
    assert parse_head(head) == (201, 57, True)
    assert parse_head(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close") == (503, 0, False)
    assert parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 2") == (200, 2, False)
    assert parse_head(b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive") == (200, 0, True)


@pytest.mark.parametrize(
    "head",
    [b"SSH-2.0-OpenSSH", b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked", b"HTTP/1.1 x"],
)
def test_parse_head_refuses_what_it_cannot_read(head: bytes) -> None:
    with pytest.raises(ValueError):
        parse_head(head)


def _index(frames: int, backfilled: int, page: int = 4096, salt: bytes = b"saltsalt") -> bytes:
    head = struct.pack("=IIIBBHII", 3007000, 0, 7, 1, 0, page, frames, 10)
    head += b"\0" * 8 + salt + b"\0" * 8  # frame checksums, salt, header checksum
    assert len(head) == 48
    return head + head + struct.pack("=I", backfilled) + b"\0" * 36


def test_parse_wal_index_reads_frames_backfill_and_salt() -> None:
    index = parse_wal_index(_index(301, 120))
    assert index == WalIndex(4096, 301, 120, b"saltsalt") and index.frame_bytes == 4120
    big = parse_wal_index(_index(5, 0, page=1))  # 65536 is stored as 1
    assert big is not None and big.page_size == 65536


def test_parse_wal_index_refuses_torn_or_foreign_headers() -> None:
    good = _index(301, 120)
    torn = good[:16] + struct.pack("=I", 302) + good[20:]  # first copy half-written
    assert parse_wal_index(torn) is None
    assert parse_wal_index(b"\0" * 136) is None
    assert parse_wal_index(good[:60]) is None


def test_descendants_walk_the_whole_subtree() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 21: 20}
    assert descendants(parents, 10) == {10, 11, 12, 13}
    assert descendants(parents, 13) == {13}
    assert descendants(parents, 99) == set()


def test_toko_threads_ran_and_waited_for_a_core_by_window() -> None:
    ticks = [
        Tick(0.0, 0.0, 0.0, 0.0, 0.0),
        Tick(2.0, 2.0, 1.0, 1.0, 0.0, loop_sched_s=(1.6, 0.2), threads_sched_s=(0.4, 0.5)),
    ]
    (w,) = window_stats([_sample(0, 0.0, 1.0)], window_s=5, duration_s=5, ticks=ticks)
    assert (w["toko_loop_ran_pct"], w["toko_loop_waited_pct"]) == (80.0, 10.0)
    assert (w["toko_threads_ran_pct"], w["toko_threads_waited_pct"]) == (20.0, 25.0)


def test_a_real_thread_s_schedstat_counts_the_time_it_ran() -> None:
    done, read = threading.Event(), threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        done.set()
        read.wait(10)  # alive until its figures are read

    before = thread_schedstats(os.getpid())
    thread = threading.Thread(target=spin)
    thread.start()
    assert done.wait(10)
    during = thread_schedstats(os.getpid())
    read.set()
    thread.join()
    assert os.getpid() in before and thread.native_id in during
    ran, waited = during[thread.native_id]
    assert ran >= 0.04 and waited >= 0.0


def test_the_run_line_tells_the_writes_a_commit_when_toko_api_logged_them() -> None:
    assert _commits_text({"commits": 80, "writes": 200, "writes_per_commit": 2.5}) == (
        "2.50 writes a commit; "
    )
    assert _commits_text(None) == ""  # an older results file, or no "store closed" line


def test_cpu_a_request_is_the_server_s_share_of_a_core_over_the_rate() -> None:
    assert cpu_per_request_us(60.0, 1000.0) == 600.0  # 0.6 of a core for 1,000/s
    assert cpu_per_request_us(21.5, 1000.0) == 215.0
    assert cpu_per_request_us(None, 1000.0) is None  # no samples taken
    assert cpu_per_request_us(50.0, 0.0) is None


def test_the_in_memory_handler_runs_on_the_interpreter_of_the_toko_measured() -> None:
    # (g) measures the package-style toko-api; its floor must be that interpreter's.
    target = baseline_target("/opt/some-venv/bin/python")
    assert target.cmd[:3] == ["/opt/some-venv/bin/python", "-m", "bench.baseline_app"]
    assert target.cwd == REPO  # where ``-m bench.baseline_app`` is found


def test_a_toko_named_on_the_command_line_is_measured_as_given() -> None:
    # No package-style venv is made (or looked for) when --toko-cmd or --toko-ref chose.
    for argv in (["--toko-cmd", "/bin/true"], ["--toko-ref", "HEAD"]):
        args = cli.parse_args(["-s", "g", *argv])
        assert cli._package_style(args) is None
