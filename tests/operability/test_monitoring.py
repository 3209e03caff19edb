"""The monitoring toko ships (deploy/prometheus, deploy/grafana), tested with real parts:
promtool checks the rules and runs their unit tests, every metric they and the
dashboard use is read from a running toko-api and from the timer jobs'
textfile reports, and a real Prometheus fires the failed-jobs alert when the
mail server refuses every email.

promtool and prometheus come from Debian's prometheus package (the Makefile's
APT_TEST); without them these tests fail rather than skip.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServiceFactory
from tests.operability.cli import run
from tests.support.api import create_products
from tests.support.ports import free_port
from tests.support.scrape import Scrape, scrape
from tests.support.smtp import SmtpServer

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "toko.rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "toko.rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "toko.json"
DATASOURCE = "${DS_PROMETHEUS}"
# Names toko exports; `up` and the label names are Prometheus' own.
METRIC_NAME = re.compile(r"\b(?:toko|process)_[a-z0-9_]+\b")
# One selector's matchers: name{label="value", label=~"regex"}.
SELECTOR = re.compile(r"\b((?:toko|process)_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r'([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
# Labels Prometheus gives every series of a target: not toko's to export.
TARGET_LABELS = {"job", "instance"}
# Labels whose values toko knows before any traffic (a status appears with its
# first answer, a 5xx hopefully never): a value selected must be among them.
BOUNDED_LABELS = {"kind", "state", "outcome", "route", "method", "le"}


def debian_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} not found: apt-get install prometheus (the Makefile's APT_TEST has it)",
            pytrace=False,
        )
    return path


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every key and value in a JSON document, however deep."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


def dashboard_queries() -> list[str]:
    """Every PromQL of the dashboard: the panels' targets and the variables' queries."""
    queries = [value for key, value in walk(dashboard()["panels"]) if key == "expr"]
    for variable in dashboard()["templating"]["list"]:
        queries.append(variable["query"]["query"])
    return queries


def queries() -> dict[str, str]:
    """Every PromQL toko ships, by where it is."""
    found = {f"rule {rule['alert']}": rule["expr"] for rule in rules()}
    found |= {f"dashboard query {i}": expr for i, expr in enumerate(dashboard_queries())}
    return found


# --- the files themselves -------------------------------------------------------------------
def test_promtool_checks_the_rules() -> None:
    done = subprocess.run(
        [debian_tool("promtool"), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_the_rules_pass_their_unit_tests() -> None:
    done = subprocess.run(
        [debian_tool("promtool"), "test", "rules", str(RULE_TESTS)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    firing = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    alerts = {rule["alert"] for rule in rules()}
    assert firing == alerts
    assert quiet == alerts


def test_every_alert_says_how_bad_it_is_and_where_to_look() -> None:
    for rule in rules():
        name = rule["alert"]
        assert "for" in rule, name
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert set(rule["annotations"]) == {"summary", "description"}, name
        commands = ("journalctl -u toko-", "toko-queue ")
        assert any(c in rule["annotations"]["description"] for c in commands), name


def test_the_dashboard_asks_for_its_datasource_on_import() -> None:
    board = dashboard()
    (wanted,) = board["__inputs"]
    assert (wanted["name"], wanted["type"], wanted["pluginId"]) == (
        "DS_PROMETHEUS",
        "datasource",
        "prometheus",
    )
    sources = [value for key, value in walk(board) if key == "datasource"]
    grafana_builtin = {"type": "grafana", "uid": "-- Grafana --"}
    assert sources and all(
        s == {"type": "prometheus", "uid": DATASOURCE} for s in sources if s != grafana_builtin
    )
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("requests", "latency", "jobs by state", "oldest due", "outcome", "duration"):
        assert topic in titles, topic
    assert "emails" in titles and "backup" in titles


# --- every metric used exists ---------------------------------------------------------------
def textfile_samples(folder: Path) -> Scrape:
    samples = {}
    for report in sorted(folder.glob("*.prom")):
        for family in text_string_to_metric_families(report.read_text()):
            for s in family.samples:
                samples[(s.name, frozenset(s.labels.items()))] = s.value
    return Scrape(samples, "text/plain")


def check_names(where: str, expr: str, exported: Scrape) -> list[str]:
    """What ``expr`` uses that ``exported`` lacks: metric names, label names and values."""
    missing = []
    by_name: dict[str, list[dict[str, str]]] = {}
    for name, labels in exported.samples:
        by_name.setdefault(name, []).append(dict(labels))
    for name in METRIC_NAME.findall(expr):
        if name not in by_name:
            missing.append(f"{where}: no metric {name}")
    for name, matchers in SELECTOR.findall(expr):
        for label, op, value in MATCHER.findall(matchers):
            if label in TARGET_LABELS or name not in by_name or "$" in value:
                continue
            values = {series[label] for series in by_name[name] if label in series}
            if not values:
                missing.append(f"{where}: {name} has no label {label}")
            elif label not in BOUNDED_LABELS:
                continue
            elif op == "=" and value not in values:
                missing.append(f"{where}: no {name}{{{label}={value!r}}} (only {sorted(values)})")
            elif op == "=~" and not any(re.fullmatch(value, v) for v in values):
                missing.append(f"{where}: nothing in {name} matches {label}=~{value!r}")
    return missing


def test_the_check_sees_a_renamed_metric_and_a_label_value_not_exported() -> None:
    exported = Scrape(
        {
            (
                "toko_job_attempts_total",
                frozenset({("kind", "product_email"), ("outcome", "failed")}),
            ): 0
        },
        "",
    )
    assert check_names("old", "increase(toko_jobs_failed_total[1h]) > 0", exported) == [
        "old: no metric toko_jobs_failed_total"
    ]
    assert check_names("typo", 'toko_job_attempts_total{outcome="failure"}', exported) == [
        "typo: no toko_job_attempts_total{outcome='failure'} (only ['failed'])"
    ]
    assert check_names("kinds", 'toko_job_attempts_total{kind=~".+_mail"}', exported) == [
        "kinds: nothing in toko_job_attempts_total matches kind=~'.+_mail'"
    ]
    assert (
        check_names("fine", 'toko_job_attempts_total{kind=~".+_email", job="toko"}', exported) == []
    )


async def test_every_metric_the_rules_and_the_dashboard_use_is_exported(
    service_factory: ServiceFactory, smtp: SmtpServer, tmp_path: Path
) -> None:
    # A rename in toko would otherwise leave an alert that can never fire.
    svc = service_factory({"TOKO_SMTP_URL": smtp.url}).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        # One request of each kind the queries select (route="/produk", method="POST").
        await create_products(session, svc.base_url, ["Kopi"])
        await smtp.async_wait_delivered(1, timeout=20)
        api = await scrape(session, svc.base_url)
    folder = tmp_path / "node-exporter"
    folder.mkdir()
    env = {
        "TOKO_DATABASE": str(tmp_path / "toko.db"),
        "TOKO_BACKUP_DIR": str(tmp_path / "backups"),
        "TOKO_TEXTFILE_DIR": str(folder),
    }
    for job in ("toko-recap", "toko-backup"):
        done = await run(job, env=env)
        assert done.returncode == 0, done
    exported = Scrape({**api.samples, **textfile_samples(folder).samples}, api.content_type)
    used = queries()
    missing = [m for where, expr in used.items() for m in check_names(where, expr, exported)]
    assert missing == []
    # The parsing found what the files use (not an empty list of names).
    names = {n for expr in used.values() for n in METRIC_NAME.findall(expr)}
    assert {"toko_job_attempts_total", "toko_backup_last_success_timestamp_seconds"} <= names
    assert len(names) > 20


# --- a real Prometheus ----------------------------------------------------------------------
class Prometheus:
    """/usr/bin/prometheus on 127.0.0.1, scraping toko-api every second."""

    def __init__(self, workdir: Path, target: str, rules: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "toko", "static_configs": [{"targets": [target]}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    debian_tool("prometheus"),
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def get(self, session: aiohttp.ClientSession, path: str) -> Any:
        async with session.get(self.url + path) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def wait_for(
        self,
        session: aiohttp.ClientSession,
        what: str,
        path: str,
        condition: Any,
        timeout: float = 60.0,  # noqa: ASYNC109
    ) -> Any:
        """Poll ``path`` until ``condition(answer)`` holds, or fail at the deadline."""
        deadline = time.monotonic() + timeout
        answer: Any = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                answer = await self.get(session, path)
            except (aiohttp.ClientConnectionError, AssertionError):
                answer = None  # not listening yet, or not ready
            if answer is not None and condition(answer):
                return answer
            await asyncio.sleep(0.2)
        pytest.fail(f"Prometheus: no {what} within {timeout:g} s: {answer}\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def firing(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [a for a in answer["data"]["alerts"] if a["state"] == "firing"]


async def test_a_real_prometheus_fires_the_failed_jobs_alert(
    service_factory: ServiceFactory, smtp: SmtpServer, tmp_path: Path
) -> None:
    smtp.refuse_subject("")  # every subject contains "": 550 to every email
    # One attempt, so a job fails for good at its first refusal. The rule's
    # own threshold and for: (0m: no waiting) are the shipped ones, loaded as
    # they are; promtool's unit tests hold them to their values.
    svc = service_factory({"TOKO_SMTP_URL": smtp.url, "TOKO_JOB_MAX_ATTEMPTS": "1"}).start()
    await svc.async_wait_ready(timeout=20)
    prometheus = Prometheus(tmp_path / "prometheus", f"127.0.0.1:{svc.port}", RULES)
    try:
        async with aiohttp.ClientSession() as session:
            await prometheus.wait_for(
                session,
                "healthy target",
                "/api/v1/targets",
                lambda a: [t["health"] for t in a["data"]["activeTargets"]] == ["up"],
            )
            # Loaded: the failed-jobs rule is there and quiet before the failure.
            groups = await prometheus.get(session, "/api/v1/rules")
            loaded = {r["name"]: r for g in groups["data"]["groups"] for r in g["rules"]}
            assert set(loaded) == {rule["alert"] for rule in rules()}
            assert loaded["TokoJobsFailed"]["state"] == "inactive"

            await create_products(session, svc.base_url, ["Ditolak"])
            created = time.monotonic()
            answer = await prometheus.wait_for(
                session,
                "firing TokoJobsFailed",
                "/api/v1/alerts",
                lambda a: any(x["labels"]["alertname"] == "TokoJobsFailed" for x in firing(a)),
            )
            seconds = time.monotonic() - created
            (alert,) = firing(answer)  # nothing else fires
            assert alert["labels"] == {
                "alertname": "TokoJobsFailed",
                "severity": "warning",
                "job": "toko",
                "instance": f"127.0.0.1:{svc.port}",
                "kind": "product_email",
                "outcome": "failed",
            }
            assert "toko-queue list --state failed" in alert["annotations"]["description"]
            assert smtp.messages("refused")
            print(f"TokoJobsFailed firing {seconds:.1f} s after the POST")
    finally:
        prometheus.close()
