"""The man pages in deploy/man/ are the ones scripts.manpages makes from the
commands' parsers and the settings spec, and render without a warning."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import manpages
from service import __version__
from service.settings_spec import PROGRAMS, VARIABLES

ROOT = Path(__file__).resolve().parents[2]
MAN = ROOT / "deploy" / "man"
PAGES = [f"{name}.8" for name in PROGRAMS] + ["toko.env.5"]
# The requests a page may use: man(7)'s, plus .nh and .ad.
REQUESTS = {"TH", "SH", "SS", "TP", "IP", "PP", "RS", "RE", "B", "nf", "fi", "nh", "ad"}


@pytest.fixture(scope="module")
def made() -> dict[str, str]:
    return manpages.pages()


def test_the_committed_pages_are_the_generated_ones(made: dict[str, str]) -> None:
    assert sorted(made) == sorted(PAGES)
    stale = manpages.stale(MAN)
    assert not stale, f"stale: {stale}; run: python -m scripts.manpages write deploy/man"
    assert sorted(p.name for p in MAN.iterdir()) == sorted(PAGES), "a page nobody generates"


def test_the_committed_completions_are_the_generated_ones() -> None:
    folder = ROOT / "deploy" / "bash-completion"
    stale = manpages.stale(folder, manpages.completions())
    assert not stale, f"stale: {stale}; run: python -m scripts.manpages completions {folder}"
    assert sorted(p.name for p in folder.iterdir()) == sorted(PROGRAMS)


def test_the_pages_do_not_change_from_run_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # No date from the clock, no width from the terminal.
    first = manpages.pages()
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    assert manpages.pages() == first


@pytest.mark.parametrize("page", PAGES)
def test_each_page_is_ascii_with_known_requests_only(made: dict[str, str], page: str) -> None:
    text = made[page]
    assert text.isascii()
    for line in text.splitlines():
        assert line.strip(), "a blank line is a vertical space in roff"
        if line.startswith((".", "'")):
            assert line[1:].split(" ")[0] in REQUESTS, line
        else:
            assert len(line.encode()) <= 80, line
    header = text.splitlines()[0]
    name, section = page.rsplit(".", 1)
    assert header.startswith(f'.TH {manpages.roff(name.upper())} "{section}" ""'), header
    assert f'"toko {__version__}"' in header


@pytest.mark.parametrize("page", PAGES)
def test_each_page_has_the_sections_an_admin_looks_for(made: dict[str, str], page: str) -> None:
    sections = re.findall(r"^\.SH (.*)$", made[page], re.MULTILINE)
    expected = ["NAME", "SYNOPSIS", "DESCRIPTION"]
    if page.endswith(".8"):
        expected += ["OPTIONS", "ENVIRONMENT", "FILES", "EXIT STATUS", "SEE ALSO"]
    else:
        expected += ["SETTINGS", "CREDENTIALS", "FILES", "SEE ALSO"]
    # toko-alert has an argument, toko-queue commands.
    assert [s for s in sections if s not in ("ARGUMENTS", "COMMANDS")] == expected
    # whatis and apropos read the NAME line: "name \- summary".
    name_line = made[page].split(".SH NAME\n", 1)[1].splitlines()[0]
    assert re.fullmatch(r"[a-z\\.-]+ \\- [^\\].*", name_line), name_line


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
        found |= {o for o in action.option_strings if o not in ("-h", "--help")}
    return found


@pytest.mark.parametrize("command", manpages.COMMANDS, ids=lambda c: c.name)
def test_every_option_and_its_help_is_in_the_page(
    made: dict[str, str], command: manpages.Command
) -> None:
    text = made[f"{command.name}.8"]
    joined = " ".join(text.split())
    for option in _options(command.parser()):
        assert f"\\fB{manpages.roff(option)}\\fR" in text, option
    parser = command.parser()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue  # man pages leave out --help, as argparse-manpage does
        if action.help and action.help != argparse.SUPPRESS and action.option_strings:
            words = " ".join(manpages.roff(str(action.help % {"prog": parser.prog})).split())
            assert words in joined, action.option_strings
    description = " ".join(manpages.roff(parser.description or "").split())
    assert description and description in joined


@pytest.mark.parametrize("command", manpages.COMMANDS, ids=lambda c: c.name)
def test_the_environment_section_lists_the_variables_the_command_reads(
    made: dict[str, str], command: manpages.Command
) -> None:
    section = made[f"{command.name}.8"].split(".SH ENVIRONMENT\n")[1].split(".SH ")[0]
    listed = set(re.findall(r"^\\fB(TOKO_[A-Z_]+)\\fR$", section, re.MULTILINE))
    reads = {v.name for v in VARIABLES if command.name in v.programs and not v.testing}
    assert listed == reads


def test_toko_env_5_has_every_setting_and_credential(made: dict[str, str]) -> None:
    text = made["toko.env.5"]
    for variable in VARIABLES:
        assert (f"\\fB{variable.name}\\fR" in text) != variable.testing, variable.name
        if variable.credential is not None and not variable.testing:
            assert f"\\fB{manpages.roff(variable.credential)}\\fR, or the file" in text
        for example in variable.examples:
            assert manpages.roff(f"{variable.name}={example}") in text.splitlines()


def _render(*command: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "MANWIDTH": "80"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)


@pytest.mark.parametrize("page", PAGES)
def test_groff_renders_each_page_without_a_warning(page: str) -> None:
    done = _render("groff", "-man", "-ww", "-z", "-Tutf8", str(MAN / page))
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("page", PAGES)
def test_man_shows_each_page_as_lintian_checks_it(page: str) -> None:
    # lintian's own command line for the groff-message tag.
    done = _render("man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", str(MAN / page))
    assert (done.returncode, done.stderr) == (0, "")
    shown = _render("man", "-l", str(MAN / page))
    assert shown.returncode == 0 and "SEE ALSO" in shown.stdout


@pytest.mark.parametrize("page", PAGES)
def test_whatis_reads_the_name_line(page: str) -> None:
    done = _render("lexgrog", str(MAN / page))
    name = page.rsplit(".", 1)[0]
    assert done.returncode == 0, done
    assert f': "{name} - ' in done.stdout


def test_the_services_do_not_load_the_generator() -> None:
    # argparse-manpage and shtab are test dependencies, not the package's.
    probe = (
        "import sys\n"
        "import service.app, service.cli, jobs.alert, jobs.backup, jobs.queue_admin, jobs.recap\n"
        "print(sorted(m for m in ('scripts.manpages', 'argparse_manpage', 'shtab')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout == "[]\n"


def test_bash_completes_commands_options_and_choices(tmp_path: Path) -> None:
    folder = tmp_path / "completions"
    assert manpages.main(["completions", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted(PROGRAMS)
    script = (
        f"source {folder / 'toko-queue'}\n"
        "COMP_WORDS=(toko-queue re); COMP_CWORD=1; _shtab_toko_queue; echo ${COMPREPLY[*]}\n"
        "COMP_WORDS=(toko-queue list --state ''); COMP_CWORD=3; _shtab_toko_queue;"
        " echo ${COMPREPLY[*]}\n"
        f"source {folder / 'toko-api'}\n"
        "COMP_WORDS=(toko-api --ch); COMP_CWORD=1; _shtab_toko_api; echo ${COMPREPLY[*]}\n"
        "COMP_WORDS=(toko-api --env-file to); COMP_CWORD=2; _shtab_toko_api;"
        " echo ${COMPREPLY[*]}\n"
    )
    (tmp_path / "toko.env").write_text("")
    done = subprocess.run(
        ["bash", "--norc", "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
        timeout=30,
        check=False,
    )
    assert done.stderr == ""
    assert done.stdout.splitlines() == [
        "retry",
        "pending running done failed",
        "--check-config",
        "toko.env",
    ]
