"""scripts.check_links: relative links and anchors in the Markdown docs resolve."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import check_links

ROOT = Path(__file__).resolve().parents[2]


def _tree(tmp_path: Path, pages: dict[str, str]) -> list[Path]:
    for name, text in pages.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return check_links.markdown_files([str(tmp_path)])


GOOD = {
    "README.md": (
        "# toko\n\n"
        "See [the tutorial](docs/tutorial.md), [how to back up](docs/how-to/backup.md#restore)"
        " and [below](#the-api-in-one-table).\n\n"
        "## The API in one table\n\n![plot](docs/plot.png)\n\n"
        "[docs]: docs/\n"
    ),
    "docs/tutorial.md": (
        "# The first hour\n\n"
        "Back to [the README](../README.md#toko); [twice](#step-1) [more](#step-1-1).\n\n"
        "## Step 1\n\n## Step 1\n\n## `toko-queue`: the queue, *repaired*\n\n"
        "[queue](#toko-queue-the-queue-repaired), [off site](https://example.com/#nothing),"
        " [mail](mailto:admin@toko.com), [a named one](how-to/backup.md#kept)\n"
    ),
    "docs/how-to/backup.md": (
        '# Back up\n\n## Restore\n\n<a id="kept"></a>Kept.\n\n'
        "```sh\n# not a heading\n[not a link](nowhere.md)\n```\n\n"
        "Code: `[not a link](nowhere.md)`.\n"
    ),
    "docs/plot.png": "",
}


def test_good_links_and_anchors_pass(tmp_path: Path) -> None:
    files = _tree(tmp_path, GOOD)
    assert check_links.check(files) == []
    assert check_links.main([str(tmp_path)]) == 0


@pytest.mark.parametrize(
    ("page", "line", "expected"),
    [
        ("docs/how-to/restore.md", "[gone](backups.md)", "no such file"),
        ("docs/how-to/restore.md", "[gone](../../README.md#no-such-heading)", "no heading"),
        ("docs/how-to/restore.md", "[self](#nowhere)", "no heading or anchor #nowhere"),
        ("docs/how-to/restore.md", "[dir](../#x)", "not a Markdown page"),
        ("docs/how-to/restore.md", "[ref]: ../tutorial.md#step-2", "no heading"),
        ("docs/how-to/restore.md", "![plot](../missing.png)", "no such file"),
    ],
)
def test_a_broken_link_or_anchor_fails(
    tmp_path: Path, page: str, line: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _tree(tmp_path, {**GOOD, page: f"# Restore\n\nText\n{line}\n"})
    problems = check_links.check(files)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{tmp_path / page}:4: ") and expected in problems[0]
    assert check_links.main([str(tmp_path)]) == 1
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("A database outside /var/lib/toko", "a-database-outside-varlibtoko"),
        ("The job queue: `toko-queue`", "the-job-queue-toko-queue"),
        ("Claims, leases and the dead letter", "claims-leases-and-the-dead-letter"),
        ("At-least-once email, stable Message-IDs", "at-least-once-email-stable-message-ids"),
        ("TOKO_DATABASE on PostgreSQL", "toko_database-on-postgresql"),
        ("[Linked](x.md) heading", "linked-heading"),
    ],
)
def test_anchors_are_slugged_as_github_does(heading: str, anchor: str) -> None:
    assert check_links.slug(heading) == anchor


def test_a_missing_argument_is_a_usage_error(tmp_path: Path) -> None:
    assert check_links.main([]) == 2
    assert check_links.main([str(tmp_path / "absent.md")]) == 2


def test_the_repositorys_docs_have_no_broken_link() -> None:
    files = check_links.markdown_files([str(ROOT / "README.md"), str(ROOT / "docs")])
    assert len(files) > 1
    assert check_links.check(files) == []
