"""Fail on a relative link or anchor that does not resolve in the Markdown docs.

    python -m scripts.check_links README.md docs

Each argument is a Markdown file or a folder searched for ``*.md``. Every
inline link and image (``[text](target)``, ``![alt](target)``) and every
reference definition (``[label]: target``) outside code is checked when its
target is relative: the file or folder must exist, and an anchor
(``page.md#section``, ``#section``) must be a heading of that page, slugged as
GitHub does (lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2``
for repeats), or an ``<a id=…>``/``<a name=…>`` in it. Links with a scheme
(``https:``, ``mailto:``) are not fetched. Headings are ATX (``## Title``) only:
setext headings (underlined) are not used in these docs. Prints one line a
problem, ``file:line: …``, and exits 1 if there is any.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)")
# [text](target) and ![alt](target): the text may hold brackets one deep.
_INLINE = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
)
_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# What a heading's text loses before it is slugged: inline markup.
_LINK_TEXT = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)")
_TAG = re.compile(r"<[^>]+>")


@dataclass(frozen=True)
class Link:
    path: Path
    line: int
    target: str


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading with this text (before de-duplication)."""
    text = _LINK_TEXT.sub(r"\1", heading)
    text = _TAG.sub("", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def _lines_outside_fences(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) for the lines that are not in a fenced code block."""
    fence = ""
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if fence:
            closes = match and match[1][0] == fence[0] and len(match[1]) >= len(fence)
            if closes and not line.strip().lstrip(fence[0]):
                fence = ""
            continue
        if match:
            fence = match[1]
            continue
        yield number, line


def anchors(text: str) -> set[str]:
    """Every anchor a page has: its headings' slugs and its HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _lines_outside_fences(text):
        found.update(_HTML_ANCHOR.findall(line))
        heading = _HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading[1] or "")
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path, text: str) -> Iterator[Link]:
    """The links of a page, outside code blocks and code spans."""
    for number, line in _lines_outside_fences(text):
        plain = _CODE_SPAN.sub("", line)
        targets = [m[1] for m in _INLINE.finditer(plain)]
        definition = _DEFINITION.match(plain)
        if definition:
            targets.append(definition[1])
        for target in targets:
            yield Link(path, number, target.removeprefix("<").removesuffix(">"))


class Checker:
    """Resolves links, reading each linked page once."""

    def __init__(self) -> None:
        self._anchors: dict[Path, set[str]] = {}

    def _anchors_of(self, page: Path) -> set[str]:
        key = page.resolve()
        if key not in self._anchors:
            self._anchors[key] = anchors(page.read_text(encoding="utf-8"))
        return self._anchors[key]

    def problem(self, link: Link) -> str | None:
        """What is wrong with ``link``, or None when it resolves (or is not relative)."""
        if not link.target or _SCHEME.match(link.target) or link.target.startswith("//"):
            return None
        address, _, anchor = link.target.partition("#")
        page = link.path if not address else link.path.parent / unquote(address)
        if not page.exists():
            return f"{link.target}: no such file {page}"
        if not anchor:
            return None
        if page.is_dir() or page.suffix != ".md":
            return f"{link.target}: an anchor into {page}, which is not a Markdown page"
        if unquote(anchor) not in self._anchors_of(page):
            return f"{link.target}: no heading or anchor #{anchor} in {page}"
        return None


def markdown_files(arguments: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for argument in arguments:
        path = Path(argument)
        files += sorted(path.rglob("*.md")) if path.is_dir() else [path]
    return files


def check(files: Iterable[Path]) -> list[str]:
    """One line a broken link in ``files``, ``file:line: what``."""
    checker = Checker()
    problems = []
    for path in files:
        for link in links(path, path.read_text(encoding="utf-8")):
            problem = checker.problem(link)
            if problem is not None:
                problems.append(f"{path}:{link.line}: {problem}")
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m scripts.check_links FILE_OR_FOLDER...", file=sys.stderr)
        return 2
    files = markdown_files(argv)
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        print(f"check_links: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    problems = check(files)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"check_links: {len(problems)} broken link(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
