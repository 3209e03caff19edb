"""The man pages, generated: toko-api(8), toko-recap(8), toko-backup(8),
toko-queue(8) and toko-alert(8) from each command's parser (``build_parser()``,
the source of its --help too) with argparse-manpage, and toko.env(5) from the
settings spec. Tests hold deploy/man/ to this output.

    python -m scripts.manpages write deploy/man    # rewrite the pages
    python -m scripts.manpages check deploy/man    # exit 1 if one is stale
    python -m scripts.manpages completions deploy/bash-completion   # (shtab)
    python -m scripts.manpages check-completions deploy/bash-completion

A development tool: argparse-manpage and shtab are test dependencies, and
nothing the services run imports this module.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from jobs import alert, backup, queue_admin, recap
from service import __version__, cli
from service.check_config import DEFAULT_CREDENTIALS_DIR, UNIT_CREDENTIALS
from service.env_file import DEFAULT_ENV_FILE, INSTALLED_STATE_DIRECTORY
from service.settings_doc import default_words, documented, help_epilog, plain_text
from service.settings_spec import PROGRAMS, VARIABLES, Variable

SOURCE = f"toko {__version__}"
# No date: one from the clock would make every run's pages differ, and the
# version (in the footer's left corner) already says which release a page is of.
DATE = ""
# Help texts are wrapped to the terminal's width: a fixed one keeps the pages
# the same whoever generates them.
_COLUMNS = "80"

_API_TOKEN = DEFAULT_CREDENTIALS_DIR / UNIT_CREDENTIALS[0]
# The drop-in toko.env(5) shows: the SMTP password's.
_SMTP_CREDENTIAL = next(v.credential for v in VARIABLES if v.name == "TOKO_SMTP_PASSWORD_FILE")
_SMTP_PASSWORD = DEFAULT_CREDENTIALS_DIR / str(_SMTP_CREDENTIAL)


def roff(text: str) -> str:
    """``text`` as roff input: backslashes and minus signs escaped, anything
    beyond ASCII as a named glyph, no line taken for a request."""
    text = text.replace("\\", "\\(rs").replace("-", "\\-").replace("\u00a0", "\\~")
    text = "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)
    lines = text.split("\n")
    return "\n".join(f"\\&{line}" if line.startswith((".", "'")) else line for line in lines)


# A reference to a man page in prose: systemd.exec(5), toko.env(5).
_PAGE_REF = re.compile(r"\b([a-z][a-z0-9_.-]*[a-z0-9])\(([1-8])\)")


def prose(text: str) -> str:
    """``text`` as roff, the man pages it names in bold as man-pages(7) asks."""
    parts = []
    end = 0
    for match in _PAGE_REF.finditer(text):
        parts += [roff(text[end : match.start()]), _page_ref(match[0])]
        end = match.end()
    parts.append(roff(text[end:]))
    return "".join(parts)


def _bold(text: str) -> str:
    return f"\\fB{roff(text)}\\fR"


def _italic(text: str) -> str:
    return f"\\fI{roff(text)}\\fR"


def _page_ref(name: str) -> str:
    title, _, section = name.rstrip(")").partition("(")
    return f"\\fB{roff(title)}\\fR({section})"


def _item(tag: str, *body: str) -> list[str]:
    """A tagged paragraph: ``tag`` (roff already), then ``body``'s paragraphs (prose)."""
    lines = [".TP", tag]
    for index, paragraph in enumerate(body):
        if index:
            lines.append(".IP")
        lines.append(prose(paragraph))
    return lines


def _code(lines: list[str]) -> list[str]:
    """``lines`` as they are, a paragraph indented (within a tagged one, by its indent)."""
    return [".IP", ".nf", *(roff(line) for line in lines), ".fi"]


# -- what the pages share


def _files(*, api_token: bool, env_page: bool = False) -> list[str]:
    settings = "this file" if env_page else "the settings, see toko.env(5)"
    lines = _item(_italic(str(DEFAULT_ENV_FILE)), settings)
    if api_token:
        lines += _item(
            _italic(str(_API_TOKEN)),
            "the token that writes must carry, readable by root only; toko-api.service "
            f"hands it to toko-api as the systemd credential {UNIT_CREDENTIALS[0]} "
            "(LoadCredential=)",
        )
    lines += _item(
        _italic(INSTALLED_STATE_DIRECTORY),
        "the state directory of the units (StateDirectory=toko), the service user's: the "
        "SQLite database toko.db and the backups/ folder, unless TOKO_DATABASE and "
        "TOKO_BACKUP_DIR say otherwise",
    )
    return lines


def _see_also(page: str, extra: tuple[str, ...], unit: str = "toko-api") -> list[str]:
    ours = [f"{name}(8)" for name in PROGRAMS] + ["toko.env(5)"]
    names = [name for name in ours if name != page] + list(extra)
    refs = ", ".join(_page_ref(name) for name in names)
    return [
        refs,
        ".PP",
        "The units, their state and their logs: "
        f"{_bold(f'systemctl status {unit}')}, {_bold('systemctl list-timers')}, "
        f"{_bold(f'journalctl -u {unit}')}.",
    ]


_SYSTEMD_PAGES = ("systemctl(1)", "journalctl(1)", "systemd.exec(5)")


# -- the commands' pages


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # the NAME line's, what whatis and apropos show
    parser: Callable[[], argparse.ArgumentParser]
    # Exit statuses and their meaning, as the command's code returns them.
    exit_status: tuple[tuple[str, str], ...]
    see_also: tuple[str, ...] = ()
    # The unit whose state and log the page points to.
    unit: str = "toko-api"


_CONFIG_EXIT = (
    "2",
    "bad configuration: one line names the variable; or wrong arguments",
)
_JOB_EXITS = (
    ("0", "done"),
    (
        "1",
        "it could not do its work: one line says why, on standard error and in the journal "
        "at error priority; under systemd its OnFailure= starts toko-alert@",
    ),
    _CONFIG_EXIT,
    (
        "143",
        "stopped by SIGTERM (systemctl stop, the unit's TimeoutStartSec=) before it "
        "finished; what it did before is kept",
    ),
)

COMMANDS = (
    Command(
        "toko-api",
        "toko product API and its email job workers",
        cli.build_parser,
        (
            ("0", "stopped as asked (SIGTERM); with --check-config, the settings are valid"),
            (
                "1",
                "it could not start or went on: another toko-api uses the database, the "
                "store failed, the address is taken, or a task of the process died; "
                "systemd restarts it (Restart=on-failure)",
            ),
            (
                "2",
                "bad configuration, or a socket from systemd it cannot use: one line names "
                "the variable, and systemd does not restart it (RestartPreventExitStatus=2); "
                "or wrong arguments",
            ),
        ),
        ("systemd.service(5)",),
    ),
    Command(
        "toko-recap",
        "record the daily product recap once and email it",
        recap.build_parser,
        _JOB_EXITS,
        ("systemd.timer(5)",),
        "toko-recap",
    ),
    Command(
        "toko-backup",
        "back up the toko database while toko-api runs, list and restore backups",
        backup.build_parser,
        _JOB_EXITS,
        ("systemd.timer(5)",),
        "toko-backup",
    ),
    Command(
        "toko-queue",
        "inspect and repair the toko job queue",
        queue_admin.build_parser,
        (
            ("0", "done"),
            (
                "1",
                "the command could not do what was asked (no such job, no database, the "
                "store failed); one line says why",
            ),
            (
                "2",
                "bad configuration or environment file: one line names the variable or line; "
                "or wrong arguments",
            ),
        ),
    ),
    Command(
        "toko-alert",
        "report a failed toko timer job in the journal and by email",
        alert.build_parser,
        (
            ("0", "the journal entry is written and the email queued"),
            (
                "1",
                "the email could not be queued (no database, the store failed); the "
                "journal entry is written all the same",
            ),
            _CONFIG_EXIT,
        ),
        ("systemd.unit(5)",),
        "'toko-alert@*'",
    ),
)


def _variable_text(variable: Variable) -> str:
    if variable.credential is not None:
        return (
            f"a file holding {plain_text(variable.help)}, else the systemd credential "
            f"{variable.credential}"
        )
    return f"{plain_text(variable.help)} {default_words(variable)}".strip()


def _environment(command: Command, epilog: str | None) -> list[str]:
    lines = []
    if epilog and epilog != help_epilog():  # toko-api's is the list below, from the spec
        lines += [prose(" ".join(epilog.split())), ".PP"]
    lines.append(
        prose(
            f"The settings it reads; the units take them from {DEFAULT_ENV_FILE}, and "
            "toko.env(5) says more of each. Secrets come from files or systemd credentials, "
            "never from the environment."
        )
    )
    for variable in documented():
        if command.name in variable.programs:
            lines += _item(_bold(variable.name), _variable_text(variable))
    return lines


@contextlib.contextmanager
def _fixed_width() -> Iterator[None]:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _COLUMNS
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def command_page(command: Command) -> str:
    """The man page of ``command``, section 8."""
    from argparse_manpage.manpage import Manpage  # type: ignore[import-untyped]

    parser = command.parser()
    epilog, parser.epilog = parser.epilog, None  # ENVIRONMENT says it instead
    # A section of their own, not (argparse-manpage's default) the end of DESCRIPTION.
    parser._positionals.title = "arguments"
    with _fixed_width():
        page = Manpage(parser, format="single-commands-section")
        page.section = 8
        page.manual = "System Manager's Manual"
        page.source = SOURCE
        page.date = DATE
        page.description = command.summary
        page.synopsis = [page.synopsis[0], *(roff(word) for word in page.synopsis[1:])]
        sections = {
            "environment": _environment(command, epilog),
            "files": _files(api_token=command.name == "toko-api"),
            "exit status": [
                line
                for code, meaning in command.exit_status
                for line in _item(_bold(code), meaning)
            ],
            "see also": _see_also(
                f"{command.name}(8)", command.see_also + _SYSTEMD_PAGES, command.unit
            ),
        }
        for heading, lines in sections.items():
            page.add_section(heading, ">", "\n".join(lines))
        return _tidy(_commands_section(str(page)))


def _commands_section(page: str) -> str:
    """argparse-manpage's COMMANDS, each command's usage line and then its
    arguments and options in one list, without --help's labels."""
    page = re.sub(r"^usage: ", "", page, flags=re.MULTILINE)
    page = re.sub(r"^(options|arguments):\n", "", page, flags=re.MULTILINE)
    return re.sub(r"^\.RE\n\s*\.RS 7\n", "", page, flags=re.MULTILINE)


def _tidy(page: str) -> str:
    """A page as mandoc -T lint and groff -ww take it without a word: a blank
    line (argparse-manpage's paragraph break) as .PP, or dropped beside a
    request that breaks anyway; a usage line's indented rest joined to it;
    ASCII only; text lines of at most 80 bytes."""
    lines: list[str] = []
    blank = False
    for line in page.split("\n"):
        if not line.strip():
            blank = True
            continue
        previous = lines[-1] if lines else ".TH"
        if previous == ".SH":
            lines[-1] = f".SH {line}"  # a heading on the line after its .SH
        elif line[0].isspace() and not previous.startswith("."):
            lines[-1] += " " + line.strip()  # the indented rest of a usage line
        else:
            if blank and not line.startswith(".") and not previous.startswith("."):
                lines.append(".PP")
            lines.append(line)
            if line.startswith(".TH "):
                # Names and paths are copied from a page: no hyphen is to be
                # put into them, nor blanks stretched around them.
                lines += [".nh", ".ad l"]
        blank = False
    text = "\n".join(wrapped for line in lines for wrapped in _wrap(line)) + "\n"
    return "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)


def _wrap(line: str) -> list[str]:
    """A text line cut at blanks into lines of at most 80 bytes (mandoc's style)."""
    if line.startswith(".") or len(line) <= 80:
        return [line]
    words = line.split(" ")
    out = [words[0]]
    for word in words[1:]:
        if len(out[-1]) + 1 + len(word) <= 80:
            out[-1] += " " + word
        else:
            out.append(word)
    return [f"\\&{part}" if part.startswith((".", "'")) else part for part in out]


# -- toko.env(5)


def _note_paragraphs(note: str) -> list[str]:
    """``note`` as roff: its lines that start with blanks as a code block."""
    lines: list[str] = []
    code: list[str] = []
    for line in note.splitlines():
        if line.startswith(" "):
            code.append(line.strip())
            continue
        if code:
            lines += _code(code)
            code = []
        lines += [".IP", prose(plain_text(line))]
    if code:
        lines += _code(code)
    return lines


def _users(variable: Variable) -> str:
    if set(variable.programs) == set(PROGRAMS):
        return "Used by every toko command."
    return f"Used by {', '.join(variable.programs)}."


def _setting(variable: Variable) -> list[str]:
    lines = _item(_bold(variable.name), f"{_variable_text(variable)}. {_users(variable)}")
    if variable.note:
        lines += _note_paragraphs(variable.note)
    if variable.examples:
        # The env example's note may end in a colon that leads to them.
        if not variable.note.endswith(":"):
            lines += [".IP", "For example:"]
        lines += _code([f"{variable.name}={value}" for value in variable.examples])
    return lines


def _credential(variable: Variable) -> list[str]:
    assert variable.credential is not None
    tag = f"{_bold(variable.credential)}, or the file {_bold(variable.name)} names"
    meaning = plain_text(variable.help) + (f"; {plain_text(variable.doc)}" if variable.doc else "")
    return _item(tag, f"{meaning}. {_users(variable)}")


def env_page() -> str:
    """toko.env(5), from the settings spec."""
    readers = [p for p in PROGRAMS if p != "toko-queue"]
    check = f"sudo toko-api --check-config --env-file {DEFAULT_ENV_FILE}"
    token = UNIT_CREDENTIALS[0]
    lines = [
        f'.TH TOKO.ENV "5" "{DATE}" "{SOURCE}" "File Formats Manual"',
        ".SH NAME",
        "toko.env \\- settings of the toko services",
        ".SH SYNOPSIS",
        _italic(str(DEFAULT_ENV_FILE)),
        ".SH DESCRIPTION",
        prose(
            f"The settings of {', '.join(readers[:-1])} and {readers[-1]}, which their "
            f"units read with EnvironmentFile=, and of toko-queue, which reads the file "
            "itself. Upgrades keep the file as you edited it. A change applies once toko-api "
            "restarts (systemctl restart toko-api); the timer jobs read it at each run. "
            "Check an edit before the restart, as root: the check reads the file and the "
            "credentials as systemd does."
        ),
        *_code([check]),
        ".PP",
        prose(
            "One VAR=value a line, as systemd reads it (systemd.exec(5), EnvironmentFile=): "
            'no "export"; a line that starts with # or ; is a comment, and a comment goes '
            'on a line of its own (VAR=x # note sets VAR to "x # note"); a value may be '
            "quoted with ' or \"; a backslash at the end of a line continues the value on "
            "the next one. The check and toko-queue refuse a line that systemd would ignore "
            "or read otherwise than it looks. A variable left out, or empty, has its default."
        ),
        ".SH SETTINGS",
    ]
    for variable in documented():
        if variable.credential is None:
            lines += _setting(variable)
    lines += [
        ".SH CREDENTIALS",
        prose(
            "Secrets do not go in this file. Each comes from the file a TOKO_..._FILE "
            "variable names, else from a systemd credential "
            "($CREDENTIALS_DIRECTORY/NAME):"
        ),
    ]
    for variable in documented():
        if variable.credential is not None:
            lines += _credential(variable)
    lines += [
        ".PP",
        prose(
            f"toko-api.service loads {token} from {_API_TOKEN} itself. Another credential "
            "needs a LoadCredential= line in a drop-in of each unit that uses it "
            "(systemctl edit toko-api), from a file readable by root only:"
        ),
        *_code(["[Service]", f"LoadCredential={_SMTP_CREDENTIAL}:{_SMTP_PASSWORD}"]),
        ".SH FILES",
        *_files(api_token=True, env_page=True),
        ".SH SEE ALSO",
        *_see_also("toko.env(5)", ("systemd.exec(5)", "systemd-creds(1)")),
    ]
    return _tidy("\n".join(lines))


# -- the set


def pages() -> dict[str, str]:
    """Each page's file name and text."""
    made = {f"{command.name}.8": command_page(command) for command in COMMANDS}
    made["toko.env.5"] = env_page()
    return made


def stale(folder: Path, generated: dict[str, str] | None = None) -> list[Path]:
    """The files in ``folder`` that differ from ``generated`` (the pages by
    default), or are missing."""
    return [
        folder / name
        for name, text in (pages() if generated is None else generated).items()
        if not (folder / name).is_file() or (folder / name).read_text() != text
    ]


# Options whose value is a path, for the completions.
_FILE_METAVARS = {"PATH", "FILE"}
_DIR_METAVARS = {"DIR"}


def completions() -> dict[str, str]:
    """Each command's bash completion script, from its parser (shtab)."""
    import shtab

    scripts = {}
    for command in COMMANDS:
        parser = command.parser()
        for action in _actions(parser):
            if action.metavar in _FILE_METAVARS:
                action.complete = shtab.FILE  # type: ignore[attr-defined]
            elif action.metavar in _DIR_METAVARS:
                action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
        scripts[command.name] = shtab.complete(parser, shell="bash")
    return scripts


def _actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "write":
        folder = Path(argv[1])
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in pages().items():
            (folder / name).write_text(text)
    elif len(argv) == 2 and argv[0] == "check":
        old = stale(Path(argv[1]))
        for path in old:
            print(f"{path} is stale: python -m scripts.manpages write {argv[1]}", file=sys.stderr)
        return 1 if old else 0
    elif len(argv) == 2 and argv[0] == "completions":
        folder = Path(argv[1])
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in completions().items():
            (folder / name).write_text(text)
    elif len(argv) == 2 and argv[0] == "check-completions":
        old = stale(Path(argv[1]), completions())
        for path in old:
            print(
                f"{path} is stale: python -m scripts.manpages completions {argv[1]}",
                file=sys.stderr,
            )
        return 1 if old else 0
    else:
        print(
            "usage: python -m scripts.manpages write|check|completions|check-completions DIR",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
