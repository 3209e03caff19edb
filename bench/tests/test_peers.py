"""The peer-stacks bench's pure helpers (bench/scenario_peers.py).

No peer library here (fastapi, uvicorn, procrastinate, arq, aiosqlite are
the bench extra's, not the tests'), no server: those run only under
``python -m bench -s peers``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.procs import REPO
from bench.scenario_peers import (
    ARQ,
    CONDITIONS,
    DEFAULT_STACKS,
    FASTAPI,
    MEMORY,
    STACKS,
    TARGETS,
    TOKO_PG,
    TOKO_SQLITE,
    PeersConfig,
    _Cpu,
    ceilings,
    cpu_between,
    drain_rate,
    markdown,
    order,
    parse_stat,
    peak,
    ratios,
    report_rows,
    shape,
    summarize,
    tree_ticks,
    verdicts,
)
from bench.toko import TokoCommand

STAT = (
    "4242 (uvicorn (worker) x) S 4200 4242 4200 0 -1 4194304 98 0 0 0"
    " 150 25 7 3 20 0 1 0 1265567 3133440 358"
)


def test_parse_stat_survives_a_command_name_with_spaces_and_parentheses() -> None:
    assert parse_stat(STAT) == (4200, 175, 10)


def test_tree_ticks_counts_descendants_and_what_the_roots_reaped() -> None:
    stats = {
        1: (0, 1000, 0),  # init: not ours
        10: (1, 5, 40),  # a root (postmaster): it reaped 40 ticks of exited backends
        11: (10, 7, 0),
        12: (11, 3, 99),  # a grandchild; what it reaped is not counted (not a root)
        20: (1, 2, 0),  # another root (the web server)
        30: (1, 500, 0),  # someone else's process
    }
    assert tree_ticks(stats, [10, 20]) == 5 + 40 + 7 + 3 + 2
    assert tree_ticks(stats, [10, 0, 999]) == 55  # pids that are gone count nothing
    assert tree_ticks(stats, []) == 0


def test_cpu_between_attributes_the_rest_to_others() -> None:
    a = _Cpu(at=0.0, machine_s=0.0, stack_s=0.0, sink_s=0.0, children_s=0.0, self_s=0.0)
    b = _Cpu(at=2.0, machine_s=3.0, stack_s=1.6, sink_s=0.2, children_s=0.6, self_s=0.2)
    cpu = cpu_between(a, b)
    assert cpu["stack_pct"] == 80.0 and cpu["wrk_pct"] == 30.0
    assert cpu["others_pct"] == 20.0  # 150 % busy minus 130 % of ours
    assert cpu["seconds"] == 2.0


def test_drain_rate_leaves_out_start_up_and_the_tail() -> None:
    samples = [(0.0, 0), (1.0, 0), (2.0, 100), (10.0, 900), (15.0, 1000)]
    assert drain_rate(samples, 1000) == 100.0


def test_drain_rate_of_a_drain_cut_at_the_time_limit() -> None:
    # 20 s of a 30,000-email backlog: a tenth of what it delivered marks the start.
    samples = [(0.0, 0), (1.0, 0), (2.0, 300), (21.0, 3000)]
    assert drain_rate(samples, 30_000) == (3000 - 300) / 19.0


def test_drain_rate_is_none_without_enough_to_go_on() -> None:
    assert drain_rate([], 100) is None
    assert drain_rate([(0.0, 0)], 0) is None
    assert drain_rate([(0.0, 0), (1.0, 5)], 1000) is None
    assert drain_rate([(3.0, 1000)], 1000) is None


def test_peak_is_the_level_with_the_most_requests() -> None:
    assert peak({"1": {"rps": 900.0}, "16": {"rps": 3000.0}, "64": {"rps": 2900.0}}) == (
        "16",
        3000.0,
    )
    assert peak({}) is None


def test_order_rotates_stacks_and_alternates_conditions() -> None:
    first, second = order(STACKS, CONDITIONS, 0), order(STACKS, CONDITIONS, 1)
    assert first[0] == (STACKS[0], "running") and first[-1] == (STACKS[-1], "parked")
    assert second[0] == (STACKS[1], "parked")
    assert sorted(first) == sorted(second)  # every run, once each
    assert len(first) == len(STACKS) * len(CONDITIONS)


def test_the_in_memory_handler_runs_parked_only_it_has_no_workers() -> None:
    for rep in (0, 1):
        runs = order(DEFAULT_STACKS, CONDITIONS, rep)
        assert [c for s, c in runs if s == MEMORY] == ["parked"]
        assert len(runs) == len(STACKS) * len(CONDITIONS) + 1


def _level(rps: float) -> dict[str, Any]:
    return {
        "rps": rps,
        "p50_ms": 16_000 / rps,
        "p99_ms": 40_000 / rps,
        "errors": 0,
        "cpu_us_per_request": 1e6 / rps,
        "cpu": {"others_pct": 2.0},
    }


def _run(stack: str, condition: str, rep: int, at16: float, drain: float) -> dict[str, Any]:
    return {
        "stack": stack,
        "condition": condition,
        "rep": rep,
        "load": {
            "levels": {"1": _level(at16 / 4), "16": _level(at16), "64": _level(at16 * 1.2)},
            "emails_per_s_while_loaded": None,
        },
        "drain": {"emails_per_s": drain, "cpu_us_per_email": 300.0, "complete": False},
    }


def _runs() -> list[dict[str, Any]]:
    rates = {TOKO_PG: 3000.0, FASTAPI: 400.0, TOKO_SQLITE: 3600.0, ARQ: 1800.0}
    parked = {TOKO_PG: 7000.0, FASTAPI: 1000.0, TOKO_SQLITE: 7500.0, ARQ: 2000.0}
    out = []
    for rep in (1, 2):
        for stack in STACKS:
            out.append(_run(stack, "running", rep, rates[stack] * rep, 100.0 * rep))
            out.append(_run(stack, "parked", rep, parked[stack], 200.0))
        out.append(_run(MEMORY, "parked", rep, 12_000.0 * rep, 0.0))
    return out


def test_ratios_pair_the_figures_of_one_repetition() -> None:
    table = ratios(_runs())
    pg = table[f"{TOKO_PG}÷{FASTAPI}"]
    running = pg["running"]
    assert running is not None and running["median"] == 7.5 and running["n"] == 2
    sqlite = table[f"{TOKO_SQLITE}÷{ARQ}"]["parked"]
    assert sqlite is not None and sqlite["median"] == 3.75


def test_a_ratio_needs_both_stacks_of_the_repetition() -> None:
    runs = [r for r in _runs() if not (r["stack"] == FASTAPI and r["rep"] == 2)]
    running = ratios(runs)[f"{TOKO_PG}÷{FASTAPI}"]["running"]
    assert running is not None and running["n"] == 1 and running["median"] == 7.5


def test_the_ceiling_is_the_handler_s_rate_over_each_peer_s_in_one_repetition() -> None:
    table = ceilings(_runs())
    assert set(table) == {f"{MEMORY}÷{FASTAPI}", f"{MEMORY}÷{ARQ}"}
    arq = table[f"{MEMORY}÷{ARQ}"]
    # rep 1: 12,000 / 1,800 and 12,000 / 2,000; rep 2: 24,000 / 3,600 and 24,000 / 2,000
    assert arq["running"] is not None and arq["running"]["min"] == arq["running"]["max"]
    assert round(arq["running"]["median"], 2) == 6.67
    assert arq["parked"] is not None and arq["parked"]["median"] == 9.0
    assert ceilings([r for r in _runs() if r["stack"] != MEMORY]) == {}


def test_verdicts_hold_each_condition_to_its_target() -> None:
    lines = verdicts(ratios(_runs()), TARGETS)
    by = {(v["pair"], v["condition"]): v for v in lines}
    assert by[(f"{TOKO_PG}÷{FASTAPI}", "running")]["met"]  # 7.5 ≥ 6
    assert by[(f"{TOKO_PG}÷{FASTAPI}", "parked")]["met"]  # 7 ≥ 3
    assert not by[(f"{TOKO_SQLITE}÷{ARQ}", "running")]["met"]  # 2 < 6
    assert by[(f"{TOKO_SQLITE}÷{ARQ}", "parked")]["target"] == 3.0
    missing = verdicts({"a÷b": {"running": None}}, TARGETS)
    assert missing == [
        {"pair": "a÷b", "condition": "running", "ratio": None, "target": 6.0, "met": False}
    ]


def test_summarize_takes_medians_and_the_peak_per_stack_and_condition() -> None:
    summary = summarize(_runs())
    f = summary[FASTAPI]["running"]
    assert f["rps@16"]["median"] == 600.0 and f["rps@16"]["min"] == 400.0
    assert f["peak_connections"] == ["64", "64"]
    assert f["drain_emails_per_s"]["median"] == 150.0
    assert f["emails_per_s_while_loaded"] is None


def _result() -> dict[str, Any]:
    cfg = PeersConfig(toko=TokoCommand(["toko-api"]))
    return shape(cfg, _runs())


def test_shape_is_json_and_fails_when_a_target_is_missed() -> None:
    result = json.loads(json.dumps(_result()))  # as --render reads it back
    assert result["met"] is False
    assert len(result["verdicts"]) == 4  # the handler is not counted
    assert set(result["differences"]) == set(DEFAULT_STACKS)
    assert set(result["ceilings"]) == {f"{MEMORY}÷{FASTAPI}", f"{MEMORY}÷{ARQ}"}


def test_report_rows_print_pass_and_fail_lines() -> None:
    rows = report_rows(json.loads(json.dumps(_result())))
    verdict_rows = [r for r in rows if r[3].endswith(("met", "missed"))]
    assert len(verdict_rows) == 4
    assert any(r[3] == "≥ 6 ✅ met" for r in verdict_rows)
    assert any(r[3] == "≥ 6 ❌ missed" for r in verdict_rows)
    ceiling_rows = [r for r in rows if r[3].startswith("beside")]
    assert len(ceiling_rows) == 4  # two peers, two conditions, none a pass or a fail
    assert all("÷" in r[0] and "not counted" in r[1] for r in ceiling_rows)
    stack_rows = [r for r in rows if "÷" not in r[0]]
    assert len(stack_rows) == len(STACKS) * len(CONDITIONS) + 1
    assert any(r[0].endswith("(not counted), no jobs") for r in stack_rows)
    assert all(r[0].startswith("(i) ") for r in rows)


def test_markdown_says_which_peer_is_not_atomic_and_where_set_ups_differ() -> None:
    text = "\n".join(markdown(json.loads(json.dumps(_result()))))
    assert "not atomic" in text
    assert "appendfsync everysec" in text
    assert "| toko, PostgreSQL ÷ FastAPI + procrastinate (PostgreSQL), (i) workers running" in text
    assert (
        "| in-memory handler ÷ aiohttp + SQLite + arq (Redis), not atomic,"
        " the peer's (i) workers running | 6.67 (6.67-6.67) | ≥ 6 |"
    ) in text


def test_a_smoke_run_is_short() -> None:
    cfg = PeersConfig(toko=TokoCommand(["toko-api"])).smoke()
    per_run = cfg.warmup_s + len(cfg.connections) * cfg.duration_s + cfg.drain_s
    assert cfg.reps == 1 and per_run <= 12


def test_the_scenario_imports_no_peer_library() -> None:
    # The peers are the bench extra's; `make test` has only the test extra.
    code = (
        "import sys, bench.scenario_peers, bench.report, bench.cli\n"
        "peers = {'fastapi', 'uvicorn', 'procrastinate', 'arq', 'aiosqlite', 'psycopg'}\n"
        "print(sorted(peers & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(REPO),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]"
