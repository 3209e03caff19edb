"""Turn a results dict into the stdout table and the Markdown for the README."""

from __future__ import annotations

from typing import Any

from bench import (
    postfix,
    scenario_disk,
    scenario_email,
    scenario_peers,
    scenario_postgres,
    scenario_queue,
    scenario_throughput,
    scenario_tutorial,
)
from bench.stats import Spread, fmt_spread, spread


def _ms(s: Spread) -> str:
    return fmt_spread(s, "{:.2f}", " ms")


def _yes(flag: object) -> str:
    return "✅ met" if flag else "❌ missed"


def _states(states: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in states.items())


def rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(scenario, measure, value, target) rows shared by both renderings."""
    out: list[tuple[str, str, str, str]] = []
    tp = results.get("throughput")
    if tp:
        s = tp["summary"]
        c = tp["config"]
        n = f"{c['connections']} conns, median of {c['runs']} x {c['duration_s']:g} s"
        labels = {
            "toko": "toko-api (durable)",
            "baseline": "in-memory baseline",
            "toko-parked": "toko-api, workers parked (diagnostic)",
        }
        for which in c.get("targets", ["toko", "baseline"]):
            label = labels.get(which, which)
            w = s[which]
            out.append(
                (
                    f"(a) POST /produk, {label}",
                    f"req/s · p50 · p99 ({n})",
                    f"{fmt_spread(w['rps'])} · {_ms(w['p50_ms'])} · {_ms(w['p99_ms'])}"
                    f" · errors {w['errors']}",
                    "",
                )
            )
        out.append(
            (
                "(a) throughput ratio",
                f"toko / baseline at {c['connections']} conns (median of per-round ratios)",
                fmt_spread(s["ratio_per_round"], "{:.2f}"),
                # Runs before issue 34 had a pass/fail line at 0.6.
                f"≥ {s['target_ratio']} {_yes(s['met'])}" if "target_ratio" in s else "",
            )
        )
        out += scenario_throughput.sweep_rows(tp)
    bl = results.get("backlog")
    if bl:
        load = bl["load"]
        c = bl["config"]
        lat = load.get("latency_ms", {})
        out.append(
            (
                "(b) 2 s emails, open loop",
                f"{c['rate']:g} req/s x {c['duration_s']:g} s, {c['workers']} workers:"
                " POST p50 · p99 · max",
                f"{lat.get('p50', float('nan')):.2f} · {lat.get('p99', float('nan')):.2f} · "
                f"{lat.get('max', float('nan')):.1f} ms (client lateness p99 "
                f"{load.get('generator_lateness_ms', {}).get('p99', float('nan')):.1f} ms;"
                f" toko CPU {load.get('cpu', {}).get('server_pct', float('nan')):.0f} %,"
                f" others {load.get('cpu', {}).get('others_pct', float('nan')):.0f} %)",
                f"p99 ≤ {c['p99_target_ms']:g} ms {_yes(bl['checks']['p99_ok'])}",
            )
        )
        out.append(
            (
                "(b) request errors",
                f"{load['requests']} sent, {load['ok_201']} x 201 at "
                f"{load['achieved_rate']:.0f} req/s",
                str(load["errors"]),
                f"0 {_yes(load['errors'] == 0)}",
            )
        )
        q = bl["queue_after_load"]
        out.append(
            (
                "(b) no job lost (after load)",
                "products · jobs · products without exactly one job",
                f"{q['products']} · {q['jobs']} · {q['products_without_one_job']}"
                f" ({_states(q['states'])})",
                _yes(bl["checks"]["one_job_per_product"]),
            )
        )
        sm = bl["smtp_during_load"]
        out.append(
            (
                "(b) emails while loaded",
                f"distinct Message-IDs in {sm['elapsed_s']:.0f} s (expected"
                f" {sm['expected_min']}-{sm['expected_max']} at {sm['expected_rate_per_s']:.2f}/s)",
                f"{sm['distinct_message_ids']} ({sm['rate_per_s']:.2f}/s), "
                f"duplicates {sm['duplicates']}",
                _yes(bl["checks"]["drain_rate_ok"]),
            )
        )
        dr = bl.get("full_drain")
        if dr:
            out.append(
                (
                    "(b) full drain (restart, 0 s emails)",
                    "distinct Message-IDs == products · duplicates · time",
                    f"{dr['distinct_message_ids']} / {dr['products']} · {dr['duplicates']}"
                    f" · {dr['seconds']:.0f} s",
                    _yes(dr["all_delivered"]),
                )
            )
    st = results.get("startup")
    if st:
        out += _startup_rows(st)
    if results.get("postgres"):
        out += scenario_postgres.report_rows(results["postgres"])
    if results.get("queue"):
        out += scenario_queue.report_rows(results["queue"])
    if results.get("tutorial"):
        out += scenario_tutorial.report_rows(results["tutorial"])
    if results.get("disk"):
        out += scenario_disk.report_rows(results["disk"])
    if results.get("sink"):
        out += postfix.report_rows(results["sink"])
    if results.get("peers"):
        out += scenario_peers.report_rows(results["peers"])
    if results.get("email"):
        out += scenario_email.report_rows(results["email"])
    return out


def text_table(results: dict[str, Any]) -> str:
    data = [("scenario", "measure", "value", "target"), *rows(results)]
    widths = [max(len(r[i]) for r in data) for i in range(4)]
    lines = []
    for n, r in enumerate(data):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine_speed(meta: dict[str, Any]) -> str:
    """The CPU probe's figures (bench.procs.cpu_probe), to tell a slow VM from slow code."""
    probes = [meta.get(key) for key in ("cpu_probe_before", "cpu_probe_after")]
    medians = [f"{p['median_us']:.1f}" for p in probes if p]
    if not medians:
        return "CPU probe not run"
    return f"CPU probe {' then '.join(medians)} µs per iteration (lower is faster)"


def markdown(results: dict[str, Any]) -> str:
    """README-ready Markdown: one small table per scenario, then the checks."""
    meta = results["meta"]
    out = [
        f"Measured {meta['started']} with `{meta['command']}` on {meta['machine']}"
        f" (toko {meta['git']}; {machine_speed(meta)}). Medians with min-max over runs"
        " in brackets.",
        "",
    ]
    tp = results.get("throughput")
    if tp:
        s, c = tp["summary"], tp["config"]
        out += [
            f"**(a) Durable `POST /produk`**, wrk, {c['connections']} connections,"
            f" {c['runs']} alternating rounds of {c['duration_s']:g} s:",
            "",
            "| Server | req/s | p50 | p99 | errors | server CPU | CPU per request |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        labels = {
            "toko": "toko-api (SQLite, synchronous=FULL, log mailer)",
            "baseline": "in-memory aiohttp baseline",
            "toko-parked": "toko-api, workers parked (diagnostic)",
        }
        for which in c.get("targets", ["toko", "baseline"]):
            w = s[which]
            cpu = [r[which].get("cpu", {}).get("server_pct", 0.0) for r in tp["rounds"]]
            # Steadier than req/s when the machine's speed drifts between runs.
            per_request = [
                r[which]["cpu"]["server_pct"] / 100 / r[which]["rps"] * 1e6
                for r in tp["rounds"]
                if r[which].get("cpu") and r[which].get("rps")
            ]
            cost = fmt_spread(spread(per_request), "{:.0f}", " µs") if per_request else "n/a"
            out.append(
                f"| {labels.get(which, which)} | {fmt_spread(w['rps'])} | {_ms(w['p50_ms'])}"
                f" | {_ms(w['p99_ms'])} | {w['errors']} | {sorted(cpu)[len(cpu) // 2]:.0f} %"
                f" | {cost} |"
            )
        others = sorted(
            r[w].get("cpu", {}).get("others_pct", 0.0)
            for r in tp["rounds"]
            for w in c.get("targets", ["toko", "baseline"])
        )
        target = f" (target ≥ {s['target_ratio']}: {_yes(s['met'])})" if "target_ratio" in s else ""
        out += [
            "",
            f"toko / baseline throughput: **{fmt_spread(s['ratio_per_round'], '{:.2f}')}**"
            f"{target}. Other processes on this"
            f" shared machine used a median {others[len(others) // 2]:.0f} % of a core"
            " during these measurements.",
            "",
            *scenario_throughput.sweep_markdown(tp),
        ]
    if results.get("queue"):
        out += scenario_queue.markdown(results["queue"])
    if results.get("disk"):
        out += scenario_disk.markdown(results["disk"])
    if results.get("peers"):
        out += scenario_peers.markdown(results["peers"])
    # (a), (e), (g) and (i) have tables of their own above.
    rest = [r for r in rows(results) if not r[0].startswith(("(a)", "(e)", "(g)", "(i)"))]
    if rest:
        out += ["| Scenario | Measure | Value | Target |", "|---|---|---|---|"]
        for r in rest:
            out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |")
    return "\n".join(out) + "\n"


def _startup_rows(st: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(c) per install; the first is held to the targets (older results: one, untargeted)."""
    installs = st.get("installs") or [{"label": "", "summary": st["summary"]}]
    targets, checks = st.get("targets"), st.get("checks")
    n = f"median of {st['config']['starts']}"
    rows = []
    for i, inst in enumerate(installs):
        s = inst["summary"]
        label = f", {inst['label']}" if inst["label"] else ""
        ready_t = rss_t = ""
        if targets and checks and i == 0:
            ready_t = f"≤ {targets['ready_ms']:g} ms {_yes(checks['ready_ms'])}"
            rss_t = f"≤ {targets['rss_mib']:g} MiB {_yes(checks['rss_mib'])}"
        rows.append(
            (
                f"(c) start to READY=1{label}",
                n,
                fmt_spread(s["ready_ms"], "{:.0f}", " ms"),
                ready_t,
            )
        )
        rows.append(
            (
                f"(c) idle RSS{label}",
                f"VmRSS after READY + {st['config']['idle_s']:g} s idle, {n}",
                fmt_spread(s["rss_mib"], "{:.1f}", " MiB"),
                rss_t,
            )
        )
    return rows
