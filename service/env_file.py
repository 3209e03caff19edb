"""The installed service's environment for commands an admin runs by hand.

toko-api gets /etc/toko/toko.env from ``EnvironmentFile=`` and its state
directory from ``StateDirectory=toko``; a shell does not. ``toko-queue`` reads
the same file so it opens the same database as the running service.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

DEFAULT_ENV_FILE = Path("/etc/toko/toko.env")
# What StateDirectory=toko gives the units (see deploy/systemd/*.service).
INSTALLED_STATE_DIRECTORY = "/var/lib/toko"


class EnvFileError(ValueError):
    """The environment file cannot be read or parsed; the message says which line."""


# The characters of systemd's env-file.c (src/basic/env-file.c): a carriage
# return ends a line as a newline does, and a backslash inside double quotes
# only escapes these four.
_NEWLINE = "\n\r"
_WHITESPACE = " \t\n\r"
_COMMENT = "#;"
_DOUBLE_QUOTE_ESCAPES = '"\\`$'
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_BOM = "\ufeff"


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """``KEY=value`` lines as systemd's EnvironmentFile= reads them.

    Quotes, backslashes and continuation lines give the values systemd gives
    (checked against systemd 252 and 257). What systemd ignores (a line that
    is no assignment, a name it does not take) or reads otherwise than it
    looks (a quote not closed on its line, text after a closing quote, a
    comment ending in a backslash) is refused with the file and line, so
    that toko-queue never works on settings the service does not have.
    """
    return _EnvFileReader(source).read(text)


class _EnvFileReader:
    """systemd's state machine, one character at a time; each state is a method."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.values: dict[str, str] = {}
        self.line = 1  # of the character being read
        self.start = 1  # where the current assignment began
        self.quote_line = 1  # where the open quote is
        self.key: list[str] = []
        self.value: list[str] = []
        # Where the unquoted value's trailing whitespace begins (systemd chomps it).
        self.trailing_space: int | None = None
        self.after_quote = False  # a closing quote, maybe whitespace after it
        self.space_after_quote = False
        self.state = self.pre_key

    def read(self, text: str) -> dict[str, str]:
        for index, char in enumerate(text):
            self.state(char)
            if char == "\n" or (char == "\r" and text[index + 1 : index + 2] != "\n"):
                self.line += 1
        self.end_of_file()
        return self.values

    def fail(self, line: int, problem: str) -> EnvFileError:
        return EnvFileError(f"{self.source}:{line}: {problem}")

    # -- the states, as in env-file.c

    def pre_key(self, char: str) -> None:
        if char in _COMMENT:
            self.state = self.comment
        elif char not in _WHITESPACE:
            self.start = self.line
            self.key = [char]
            self.state = self.in_key

    def in_key(self, char: str) -> None:
        if char in _NEWLINE:
            raise self.no_assignment()
        if char == "=":
            self.value = []
            self.trailing_space = None
            self.after_quote = self.space_after_quote = False
            self.state = self.pre_value
        else:
            self.key.append(char)

    def pre_value(self, char: str) -> None:
        if char in _NEWLINE:
            self.push()
        elif char in _WHITESPACE:
            self.space_after_quote = self.after_quote
        elif self.space_after_quote:
            # systemd drops the space and joins the rest: "x" # note -> 'x# note'.
            raise self.fail(
                self.line,
                f"text after the closing quote of {self.name()}, which systemd would join "
                "to the value without the space (quote all of it; comments go on their own line)",
            )
        elif char in "'\"":
            self.quote_line = self.line
            self.state = self.single_quoted if char == "'" else self.double_quoted
        elif char == "\\":
            self.state = self.value_escape
        else:
            self.state = self.unquoted
            self.value.append(char)

    def unquoted(self, char: str) -> None:
        if char in _NEWLINE:
            self.push()
        elif char == "\\":
            self.trailing_space = None
            self.state = self.value_escape
        else:
            if char not in _WHITESPACE:
                self.trailing_space = None
            elif self.trailing_space is None:
                self.trailing_space = len(self.value)
            self.value.append(char)

    def value_escape(self, char: str) -> None:
        # A backslash before a line break continues the value on the next line.
        self.state = self.unquoted
        if char not in _NEWLINE:
            self.value.append(char)

    def single_quoted(self, char: str) -> None:
        if char == "'":
            self.close_quote()
        elif char in _NEWLINE:
            raise self.unclosed_quote()
        else:
            self.value.append(char)

    def double_quoted(self, char: str) -> None:
        if char == '"':
            self.close_quote()
        elif char == "\\":
            self.state = self.double_quote_escape
        elif char in _NEWLINE:
            raise self.unclosed_quote()
        else:
            self.value.append(char)

    def double_quote_escape(self, char: str) -> None:
        self.state = self.double_quoted
        if char in _DOUBLE_QUOTE_ESCAPES:
            self.value.append(char)
        elif char != "\n":  # an escaped newline continues the value
            self.value.extend(("\\", char))

    def comment(self, char: str) -> None:
        if char == "\\":
            self.state = self.comment_escape
        elif char in _NEWLINE:
            self.state = self.pre_key

    def comment_escape(self, char: str) -> None:
        if char in _NEWLINE:
            # systemd 252 continues the comment onto the next line; 257 does not.
            raise self.fail(
                self.line,
                "a comment ends in a backslash, which makes systemd 252 "
                "skip the next line too; remove the backslash",
            )
        self.state = self.comment

    # -- assignments

    def end_of_file(self) -> None:
        if self.state in (self.single_quoted, self.double_quoted, self.double_quote_escape):
            raise self.unclosed_quote()
        if self.state == self.in_key:
            raise self.no_assignment()
        if self.state in (self.pre_value, self.unquoted, self.value_escape):
            self.push()

    def push(self) -> None:
        if self.state == self.unquoted and self.trailing_space is not None:
            del self.value[self.trailing_space :]
        name = self.name()
        if not _NAME.match(name):
            raise self.bad_name(name)
        self.values[name] = "".join(self.value)
        self.state = self.pre_key

    def name(self) -> str:
        return "".join(self.key).rstrip(" \t")

    def bad_name(self, name: str) -> EnvFileError:
        if name.startswith(_BOM):
            return self.fail(
                self.start,
                "the file starts with a byte order mark, which makes systemd ignore "
                "this line; save it as UTF-8 without one",
            )
        if name.startswith(("export ", "export\t")):
            return self.fail(
                self.start, f"systemd ignores a line with 'export': write {name[7:].strip()}=..."
            )
        return self.fail(
            self.start,
            f"{name!r} is not a variable name systemd takes (letters, digits and _, "
            "not first a digit); it would ignore this line",
        )

    def no_assignment(self) -> EnvFileError:
        return self.fail(
            self.start, f"expected KEY=value, got {self.name()!r} (systemd would ignore it)"
        )

    def unclosed_quote(self) -> EnvFileError:
        return self.fail(
            self.quote_line,
            f"the quote in the value of {self.name()} is not closed on its line; systemd "
            "would read the lines after it into the value",
        )

    def close_quote(self) -> None:
        self.after_quote = True
        self.state = self.pre_value


def cli_environment(
    environ: Mapping[str, str], env_file: str | None, *, use_default: bool = True
) -> dict[str, str]:
    """``environ`` plus the env file's values (the caller's own variables win).

    Without ``env_file``, /etc/toko/toko.env is used when it exists and the
    caller did not name a database (``TOKO_DATABASE``) themselves; when it
    does not exist, the database is still the installed service's if
    /var/lib/toko exists.
    """
    path: Path | None = Path(env_file) if env_file else None
    if path is None and use_default and "TOKO_DATABASE" not in environ:
        if DEFAULT_ENV_FILE.exists():
            path = DEFAULT_ENV_FILE
        elif Path(INSTALLED_STATE_DIRECTORY).is_dir():
            # The units read the file only if it is there (EnvironmentFile=-);
            # toko-api then still keeps its database in StateDirectory=, not
            # ./var. A development machine has no such directory: ./var it is.
            return {"STATE_DIRECTORY": INSTALLED_STATE_DIRECTORY, **environ}
    if path is None:
        return dict(environ)
    try:
        data = path.read_bytes()
    except OSError as exc:
        hint = " (run as the service user: sudo -u toko ...)" if exc.errno == 13 else ""
        raise EnvFileError(f"cannot read {path}: {exc.strerror}{hint}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Where, not what: the bytes would not print, and the line may hold a secret.
        line = data.count(b"\n", 0, exc.start) + 1
        raise EnvFileError(
            f"{path}:{line}: not UTF-8 text (byte {exc.start} of the file); save it as UTF-8"
        ) from None
    merged = {**parse_env_file(text, str(path)), **environ}
    # The units' StateDirectory= is where the default database lives.
    merged.setdefault("STATE_DIRECTORY", INSTALLED_STATE_DIRECTORY)
    return merged
