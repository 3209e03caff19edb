"""toko-queue reads /etc/toko/toko.env as systemd's EnvironmentFile= does.

Every expected value below is what ``systemd-run --pipe --wait -p
EnvironmentFile=FILE /usr/bin/env -0`` printed for the same bytes, checked
against systemd 252 (Debian 12) and 257 (Debian 13) in a container; the two
agreed on all of them.
"""

from __future__ import annotations

import pytest

from service.env_file import EnvFileError, parse_env_file

AS_SYSTEMD_READS_IT: dict[str, dict[str, str]] = {
    "A=1\n": {"A": "1"},
    'A="hello world"\n': {"A": "hello world"},
    "A='hello world'\n": {"A": "hello world"},
    # Inside double quotes a backslash escapes only " \ ` $; other pairs stay.
    'A="say \\"hi\\""\n': {"A": 'say "hi"'},
    'A="c:\\\\dir"\n': {"A": "c:\\dir"},
    'A="\\$x \\`y"\n': {"A": "$x `y"},
    'A="a\\nb"\n': {"A": "a\\nb"},
    # Inside single quotes a backslash is itself, and the quote ends there.
    "A='a\\nb'\n": {"A": "a\\nb"},
    "A='a\\'b'\n": {"A": "a\\b'"},
    # Unquoted, a backslash escapes the next character, whatever it is.
    "A=a\\nb\n": {"A": "anb"},
    "A=C:\\dir\n": {"A": "C:dir"},
    "A=a\\ b\n": {"A": "a b"},
    "A=abc\\ \n": {"A": "abc "},
    "A=abc\\": {"A": "abc"},
    # No comments after a value: # and ; are part of it.
    "A=x#y\n": {"A": "x#y"},
    'A="x # y"\n': {"A": "x # y"},
    "A=x # y\n": {"A": "x # y"},
    "A=x;y\n": {"A": "x;y"},
    # Whitespace around the name, "=" and an unquoted value is dropped.
    "A=abc   \n": {"A": "abc"},
    "A=abc\t\n": {"A": "abc"},
    "A=a  b   c\n": {"A": "a  b   c"},
    "A = 1\n": {"A": "1"},
    "A\t=\t1\n": {"A": "1"},
    "   A=1\n": {"A": "1"},
    'A=  "x"   \n': {"A": "x"},
    'A="x "\n': {"A": "x "},
    # A backslash before the line break continues the value.
    "A=one \\\ntwo\n": {"A": "one two"},
    "A=one\\\ntwo\n": {"A": "onetwo"},
    'A="one \\\ntwo"\n': {"A": "one two"},
    "A=1 \\\n# c\nB=2\n": {"A": "1 # c", "B": "2"},
    "A=\\\nB=2\n": {"A": "B=2"},
    # Quoted and unquoted parts next to each other are joined, as in a shell.
    "A='it'\"'\"'s'\n": {"A": "it's"},
    'A="x"y\n': {"A": "xy"},
    "A=\"x\"'y'\n": {"A": "xy"},
    'A="x"#y\n': {"A": "x#y"},
    'A=x"y z"\n': {"A": 'x"y z"'},
    'A=""""\n': {"A": ""},
    # A carriage return ends a line as a newline does.
    "A=1\r\nB=two\r\n": {"A": "1", "B": "two"},
    'A="x y"\r\nB=2\r\n': {"A": "x y", "B": "2"},
    "A=1\rB=2\r": {"A": "1", "B": "2"},
    # Form feeds and Unicode line separators are no line breaks to systemd.
    "A=a\x0cb\n": {"A": "a\x0cb"},
    "A=a\x0bb\n": {"A": "a\x0bb"},
    "A=a\x85b\n": {"A": "a\x85b"},
    "A=a\u2028b\n": {"A": "a\u2028b"},
    "A=\n": {"A": ""},
    'A=""\n': {"A": ""},
    "A=1\nA=2\n": {"A": "2"},
    "\n   \n\t\n   # c\n; c\n  ; c\n# a\\b\nA=1\n": {"A": "1"},
    "A=1": {"A": "1"},
    "A=$HOME ${HOME}/x `x`\n": {"A": "$HOME ${HOME}/x `x`"},
    'A="$HOME"\n': {"A": "$HOME"},
    "toko_x=1\n": {"toko_x": "1"},
    "A=b=c\n": {"A": "b=c"},
    "A=kopi ☕ café\n": {"A": "kopi ☕ café"},
    "TOKO_DATABASE=postgresql://u:p@h/db?sslmode=require\n": {
        "TOKO_DATABASE": "postgresql://u:p@h/db?sslmode=require"
    },
}


@pytest.mark.parametrize(("text", "expected"), AS_SYSTEMD_READS_IT.items())
def test_values_are_those_systemd_gives(text: str, expected: dict[str, str]) -> None:
    assert parse_env_file(text, "toko.env") == expected


# What systemd ignores (it logs "Ignoring invalid environment assignment", or
# nothing) or reads otherwise than the line looks, with what it gave instead.
REFUSED: dict[str, tuple[int, str]] = {
    "export A=1\n": (1, "'export'"),  # ignored
    "export\tA=1\n": (1, "'export'"),  # ignored
    "\ufeffA=1\nB=2\n": (1, "byte order mark"),  # A ignored
    "A=1\nJUSTAWORD\nB=2\n": (2, "expected KEY=value"),  # ignored, silently
    "=1\n": (1, "expected KEY=value"),  # ignored, silently
    "  =1\nB=2\n": (1, "expected KEY=value"),  # ignored, silently
    "A\r=1\n": (1, "expected KEY=value"),  # ignored, silently
    "1A=1\n": (1, "'1A' is not a variable name"),  # ignored
    "A-B=1\n": (1, "'A-B' is not a variable name"),  # ignored
    "A.B=1\n": (1, "'A.B' is not a variable name"),  # ignored
    "A B=1\n": (1, "'A B' is not a variable name"),  # ignored
    "A\tB=1\n": (1, "'A\\tB' is not a variable name"),  # ignored
    "A=one \\\r\ntwo\r\n": (2, "expected KEY=value"),  # A='one ', two ignored
    'A="x" # comment\n': (1, "text after the closing quote of A"),  # 'x# comment'
    'A="Toko Shop" <toko@x>\n': (1, "text after the closing quote"),  # 'Toko Shop<toko@x>'
    'A="a" "b"\n': (1, "text after the closing quote"),  # 'ab'
    "A='x' y\n": (1, "text after the closing quote"),  # 'xy'
    'A="abc\nB=2\n': (1, "quote in the value of A is not closed"),  # 'abc\nB=2\n'
    "A='abc\nB=2\n": (1, "quote in the value of A is not closed"),  # 'abc\nB=2\n'
    "B=1\nA='abc\nB='x'\n": (2, "not closed"),  # A="abc\nB=x'"
    'A="\n': (1, "not closed"),  # '\n'
    "A=\"abc'\n": (1, "not closed"),  # "abc'\n"
    "A='abc": (1, "not closed"),  # 'abc'
    "A='one \\\ntwo'\n": (1, "not closed"),  # 'one \\\ntwo'
    'A="one\ntwo"\n': (1, "not closed"),  # 'one\ntwo'
    'A="one\r\ntwo"\r\n': (1, "not closed"),  # 'one\ntwo'
    'A="a\rb"\n': (1, "not closed"),  # 'a\nb'
    # systemd 252 also skips the next line (B only); 257 does not (A and B).
    "# was C:\\toko\\\nA=1\nB=2\n": (1, "comment ends in a backslash"),
    "B=2\n; x \\\nA=1\n": (2, "comment ends in a backslash"),
}


@pytest.mark.parametrize(("text", "where"), REFUSED.items())
def test_what_systemd_ignores_or_misreads_is_refused_with_its_line(
    text: str, where: tuple[int, str]
) -> None:
    line, problem = where
    with pytest.raises(EnvFileError) as refused:
        parse_env_file(text, "/etc/toko/toko.env")
    message = str(refused.value)
    assert message.startswith(f"/etc/toko/toko.env:{line}: "), message
    assert problem in message
    assert "\n" not in message


def test_a_refusal_names_the_variable_but_not_its_value() -> None:
    # The value may be a secret; the name says enough to find the line.
    with pytest.raises(EnvFileError) as refused:
        parse_env_file('TOKO_DATABASE="postgresql://u:s3cret@h/db\n', "toko.env")
    assert "TOKO_DATABASE" in str(refused.value)
    assert "s3cret" not in str(refused.value)
