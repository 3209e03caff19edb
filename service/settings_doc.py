"""The settings' documentation, generated from their spec (service.settings_spec):
toko-api's --help epilog, deploy/toko.env.example and the table of the
configuration reference, docs/reference/configuration.md. Tests hold the
committed files to this output.

    python -m service.settings_doc env-example > deploy/toko.env.example
    python -m service.settings_doc table    # the reference's table
    python -m service.settings_doc write    # rewrite both files in place
    python -m service.settings_doc check    # exit 1 if either is stale
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from service.settings_spec import PROGRAMS, VARIABLES, Variable

ROOT = Path(__file__).resolve().parent.parent
ENV_EXAMPLE = ROOT / "deploy" / "toko.env.example"
REFERENCE = ROOT / "docs" / "reference" / "configuration.md"

# The reference's table, between these two comments (which a rendered page
# does not show): this header, then one row a variable.
TABLE_START = "<!-- the settings table: python -m service.settings_doc write -->\n"
TABLE_END = "<!-- end of the settings table -->\n"
TABLE_HEADER = "| variable | default | meaning |\n| --- | --- | --- |\n"

_WIDTH = 79


def documented() -> list[Variable]:
    return [variable for variable in VARIABLES if not variable.testing]


def _plain(text: str) -> str:
    """``text`` without the Markdown code marks."""
    return text.replace("`", "")


# Between "default" and the value, so that a wrapped line does not end in "(default".
_NO_BREAK = "\u00a0"


def _default_words(variable: Variable) -> str:
    """The default, as the help and the env example give it after the text."""
    if variable.default_doc:
        words = _plain(variable.default_doc)
        return f"({words})" if words.startswith("unset") else f"(default{_NO_BREAK}{words})"
    return f"(default{_NO_BREAK}{variable.default})" if variable.default is not None else ""


def _wrap(text: str, initial_indent: str, subsequent_indent: str) -> list[str]:
    lines = textwrap.wrap(
        text,
        _WIDTH,
        initial_indent=initial_indent,
        subsequent_indent=subsequent_indent,
        break_on_hyphens=False,
        break_long_words=False,
    )
    return [line.replace(_NO_BREAK, " ") for line in lines]


def help_epilog() -> str:
    """What ``toko-api --help`` says of the configuration, after its options."""
    plain = [v for v in documented() if v.credential is None]
    secrets = [v for v in documented() if v.credential is not None]
    lines = ["configuration comes from the environment (under systemd: /etc/toko/toko.env):"]
    name_width = max(len(v.name) for v in plain) + 2
    for variable in plain:
        text = f"{_plain(variable.help)} {_default_words(variable)}".strip()
        lines += _wrap(text, f"  {variable.name:<{name_width}}", " " * (2 + name_width))
    lines.append("Secrets come from systemd credentials or files, never from the environment:")
    credential_width = max(len(v.credential or "") for v in secrets) + 2
    file_width = max(len(v.name) for v in secrets) + 2
    for variable in secrets:
        lines.append(
            f"  {variable.credential:<{credential_width}}or {variable.name:<{file_width}}"
            f"{_plain(variable.help)}"
        )
    return "\n".join(lines) + "\n"


_ENV_HEADER = """\
# toko configuration, read by {readers}
# (EnvironmentFile= of their units), and by {queue} itself. A conffile of
# the toko package: upgrades keep your changes (dpkg asks when both changed).
# Check an edit, then apply it:
#   toko-api --check-config --env-file /etc/toko/toko.env
#   systemctl restart toko-api
# Syntax: VAR=value, one a line, no "export"; a comment goes on a line of its
# own ("VAR=x # note" sets VAR to "x # note").
# Secrets do not belong here: give the SMTP password as a systemd credential
# (see CREDENTIALS in man toko.env).
#
# Generated from service/settings_spec.py: python -m service.settings_doc write
"""


def _comment(text: str) -> list[str]:
    """``text`` as comment lines; a line that starts with spaces is kept as it is."""
    lines: list[str] = []
    for paragraph in text.splitlines():
        if paragraph.startswith(" "):
            lines.append(f"# {paragraph}")
        else:
            lines += _wrap(paragraph, "# ", "# ")
    return lines


def env_example() -> str:
    """deploy/toko.env.example: every documented setting but the secrets, commented out."""
    units = [p for p in PROGRAMS if p != "toko-queue"]
    readers = ", ".join(units[:-1]) + f" and {units[-1]}"
    lines = [_ENV_HEADER.format(readers=readers, queue="toko-queue").rstrip("\n")]
    for variable in documented():
        if variable.credential is not None:
            continue
        lines.append("")
        lines += _comment(f"{_plain(variable.help)} {_default_words(variable)}".strip())
        if variable.note:
            lines += _comment(variable.note)
        for value in variable.examples or (variable.default or "",):
            lines.append(f"#{variable.name}={value}")
    return "\n".join(lines) + "\n"


def _table_default(variable: Variable) -> str:
    if variable.default_doc:
        return variable.default_doc
    return f"`{variable.default}`" if variable.default is not None else "unset"


def _table_meaning(variable: Variable) -> str:
    if variable.credential is None:
        return variable.doc or variable.help
    meaning = (
        f"file holding {variable.help} (under systemd: the credential `{variable.credential}`)"
    )
    return f"{meaning}; {variable.doc}" if variable.doc else meaning


def table() -> str:
    """The configuration reference's table: its header, then one row a documented variable."""
    return TABLE_HEADER + "".join(
        f"| `{v.name}` | {_table_default(v)} | {_table_meaning(v)} |\n" for v in documented()
    )


def with_table(page: str) -> str:
    """``page`` (the configuration reference) with the spec's table between its markers."""
    start = page.index(TABLE_START) + len(TABLE_START)
    end = page.index(TABLE_END, start)
    return page[:start] + table() + page[end:]


def _stale() -> list[Path]:
    stale = []
    if ENV_EXAMPLE.read_text() != env_example():
        stale.append(ENV_EXAMPLE)
    page = REFERENCE.read_text()
    if with_table(page) != page:
        stale.append(REFERENCE)
    return stale


# The same words for the man pages (scripts/manpages.py) as for the help and the env example.
plain_text = _plain
default_words = _default_words


def main(argv: list[str]) -> int:
    command = argv[0] if len(argv) == 1 else ""
    if command == "env-example":
        sys.stdout.write(env_example())
    elif command == "table":
        sys.stdout.write(table())
    elif command == "help":
        sys.stdout.write(help_epilog())
    elif command == "write":
        ENV_EXAMPLE.write_text(env_example())
        REFERENCE.write_text(with_table(REFERENCE.read_text()))
    elif command == "check":
        stale = _stale()
        for path in stale:
            print(f"{path} is stale: python -m service.settings_doc write", file=sys.stderr)
        return 1 if stale else 0
    else:
        print(
            "usage: python -m service.settings_doc env-example|table|help|write|check",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
