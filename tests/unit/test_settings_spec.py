"""The settings' spec is the one source: the Settings dataclass, the env example,
the configuration reference's table (and every TOKO_ name the docs give),
toko-api --help and the programs said to read each variable are all held to it."""

from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from service import cli, settings_doc
from service.env_file import parse_env_file
from service.settings import ConfigError, HttpSettings, Settings
from service.settings_spec import PROGRAMS, VARIABLES, Variable

ROOT = Path(__file__).resolve().parents[2]
# Settings fields that no TOKO_ variable sets: systemd's contract and bookkeeping.
NOT_FROM_A_VARIABLE = {
    "http.max_body_bytes",
    "http.listen_given",
    "systemd.notify_socket",
    "systemd.watchdog_interval",
    "log.journal",
    "unknown_variables",
}


def _field_paths() -> set[str]:
    """Settings' fields as ``group.field``, and the ungrouped ones by name."""
    paths = set()
    for group in dataclasses.fields(Settings):
        default = getattr(Settings(), group.name)
        if dataclasses.is_dataclass(default):
            paths |= {f"{group.name}.{f.name}" for f in dataclasses.fields(default)}
        else:
            paths.add(group.name)
    return paths


def test_settings_without_configuration_are_the_defaults_of_from_env() -> None:
    assert Settings() == Settings.from_env({})


def test_every_settings_field_comes_from_one_variable_or_is_not_configurable() -> None:
    fields = _field_paths()
    set_by = [".".join(name.split(".")[:2]) for v in VARIABLES for name in v.fields]
    assert len({v.name for v in VARIABLES}) == len(VARIABLES)
    assert set(set_by) <= fields
    assert fields - set(set_by) == NOT_FROM_A_VARIABLE
    # One variable a field, but the SMTP password, which goes into TOKO_SMTP_URL's value.
    twice = [name for name, count in Counter(set_by).items() if count > 1]
    assert twice == ["mail.smtp"]
    assert [f for v in VARIABLES for f in v.fields if f.count(".") > 1] == ["mail.smtp.password"]


def test_every_variable_has_a_default_or_says_what_unset_means() -> None:
    for v in VARIABLES:
        assert v.help and v.help == v.help.strip() and not v.help.endswith("."), v.name
        assert set(v.programs) <= set(PROGRAMS) and v.programs, v.name
        if v.credential is None and not v.testing:
            assert (v.default is None) != (v.default_doc == ""), v.name


@pytest.mark.parametrize("variable", [v for v in VARIABLES if v.default is not None], ids=str)
def test_a_default_written_in_toko_env_gives_the_same_settings(variable: Variable) -> None:
    assert variable.default is not None
    given = Settings.from_env({variable.name: variable.default})
    assert given == Settings(http=HttpSettings(listen_given=variable.name == "TOKO_LISTEN"))


def test_the_env_example_is_generated_from_the_spec() -> None:
    committed = (ROOT / "deploy" / "toko.env.example").read_text()
    assert committed == settings_doc.env_example(), (
        "deploy/toko.env.example is stale: python -m service.settings_doc write"
    )


def test_the_env_example_sets_nothing_and_each_line_in_it_is_a_valid_setting() -> None:
    text = settings_doc.env_example()
    assert parse_env_file(text, "toko.env.example") == {}
    examples = re.findall(r"^#(TOKO_[A-Z_]+=.*)$", text, re.MULTILINE)
    shown = {line.partition("=")[0] for line in examples}
    assert shown == {v.name for v in VARIABLES if not v.testing and v.credential is None}
    for line in examples:
        environ = parse_env_file(line + "\n", "toko.env.example")
        try:
            Settings.from_env(environ)
        except ConfigError as exc:
            pytest.fail(f"{line}: {exc}")


def test_the_configuration_reference_is_the_specs() -> None:
    page = settings_doc.REFERENCE.read_text()
    assert settings_doc.with_table(page) == page, (
        f"{settings_doc.REFERENCE.relative_to(ROOT)} is stale: python -m service.settings_doc write"
    )
    table = page[page.index(settings_doc.TABLE_START) : page.index(settings_doc.TABLE_END)]
    rows = {
        match[1]: match[2]
        for match in re.finditer(r"^\| `(TOKO_[A-Z_]+)` \| (.*?) \| .* \|$", table, re.MULTILINE)
    }
    for v in VARIABLES:
        if v.testing:
            assert v.name not in rows
        elif v.default is not None:
            assert rows[v.name] == f"`{v.default}`", v.name
        else:
            assert rows[v.name] == (v.default_doc or "unset"), v.name


DOCUMENTED = {v.name for v in VARIABLES if not v.testing}
# TOKO_ names the docs may give that are no setting: the test suite's knobs
# (docs/development.md) and the typo of the unknown-variable warning's example.
NOT_SETTINGS = re.compile(r"TOKO_(SYSTEST_|CRASH_|PG_CRASH_)[A-Z_]+|TOKO_WORKER")


def test_the_configuration_reference_names_every_variable_and_no_other() -> None:
    text = settings_doc.REFERENCE.read_text()
    named = {n for n in re.findall(r"\bTOKO_[A-Z_]*[A-Z]\b", text) if not NOT_SETTINGS.fullmatch(n)}
    assert DOCUMENTED - named == set(), "missing from the configuration reference"
    assert named - DOCUMENTED == set(), "in the configuration reference, but no setting"


def test_the_docs_name_no_variable_that_is_not_a_setting() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = {
        f"{page.relative_to(ROOT)}: {name}"
        for page in pages
        for name in re.findall(r"\bTOKO_[A-Z_]*[A-Z]\b", page.read_text())
        if name not in DOCUMENTED and not NOT_SETTINGS.fullmatch(name)
    }
    assert unknown == set(), "documented, but toko reads no such variable"


def test_toko_api_help_lists_every_variable_with_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    out = capsys.readouterr().out
    assert settings_doc.help_epilog() in out
    flat = " ".join(out.split())
    for v in VARIABLES:
        assert (v.name in out) != v.testing, v.name
        if v.default is not None and not v.testing:
            assert f"{v.name} " in out and f"(default {v.default})" in flat, v.name
        if v.credential is not None:
            assert re.search(rf"^  {v.credential} +or {v.name} ", out, re.MULTILINE), v.name


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _modules_of(entry: str) -> set[Path]:
    """The files of the project a console script's module imports, at any depth."""
    seen: set[Path] = set()
    todo = [entry]
    while todo:
        path = _module_file(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                todo.append(node.module)
                todo += [f"{node.module}.{alias.name}" for alias in node.names]
    return {p for p in seen if p.parts[len(ROOT.parts)] in {"service", "jobs"}}


_ACCESS = re.compile(r"(?:\bsettings|\[SETTINGS\])\.([a-z_]+\.[a-z_]+)")
# Modules a program imports for a helper, not for what they do with settings:
# toko-queue takes anothers_database from jobs.common, and runs no run_job.
_HELPERS_ONLY = {"toko-queue": [ROOT / "jobs" / "common.py"]}
# Properties of Settings, and the variables' fields they stand for.
_PROPERTIES = {"store.is_postgres": "store.database"}


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_programs_said_to_read_a_variable_are_the_ones_that_do(program: str) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry = scripts[program].partition(":")[0]
    read = set()
    # Not service/settings.py itself: the fields it touches are for the callers'
    # checks (check_for_api: toko-api's), not for every program importing it.
    skipped = {ROOT / "service" / "settings.py", *_HELPERS_ONLY.get(program, ())}
    for path in _modules_of(entry) - skipped:
        for name in _ACCESS.findall(path.read_text()):
            read.add(_PROPERTIES.get(name, name))
    uses = {v.name for v in VARIABLES if read & {".".join(f.split(".")[:2]) for f in v.fields}}
    declared = {v.name for v in VARIABLES if program in v.programs}
    assert uses == declared, (sorted(uses - declared), sorted(declared - uses))
