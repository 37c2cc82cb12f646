"""The docs cite tests by name: every name they cite exists, and every fault, bad-input and
security test (and every cell of the fault matrix) is in docs/reliability.md's tables. Every
relative link in the docs and the README leads somewhere, and docs/benchmarks.md stays a page
of today's numbers (the dated write-ups go to docs/benchmarks-notebook.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"`(test_[A-Za-z0-9_]+)`")
DEFINED = re.compile(r"^(?:async )?def (test_[A-Za-z0-9_]+)\(", re.M)


def defined_tests(*files: str) -> set[str]:
    paths = [ROOT / "tests" / f for f in files] if files else sorted((ROOT / "tests").glob("test_*.py"))
    return {name for path in paths for name in DEFINED.findall(path.read_text())}


@pytest.mark.parametrize("doc", ["reliability.md", "semantics.md"])
def test_every_test_a_doc_cites_exists(doc: str) -> None:
    cited = set(CITED.findall((ROOT / "docs" / doc).read_text()))
    assert cited, f"docs/{doc} cites no tests"
    assert sorted(cited - defined_tests()) == []


def test_every_fault_bad_input_and_security_test_is_in_the_reliability_tables() -> None:
    cited = set(CITED.findall((ROOT / "docs/reliability.md").read_text()))
    missing = defined_tests("test_faults.py", "test_fault_matrix.py", "test_bad_input.py", "test_security.py") - cited
    assert sorted(missing) == []


def test_usage_lists_every_setting_as_the_table_says() -> None:
    """docs/usage.md's settings reference is the settings table; regenerate it with
    `python -m marinfs.config.mount` when a setting changes."""
    from marinfs.config.mount import SETTINGS
    from marinfs.config.settings import markdown_table

    text = (ROOT / "docs/usage.md").read_text()
    begin = text.index("<!-- settings table:")
    section = text[text.index("\n", begin) + 1:text.index("<!-- end of settings table -->")]
    assert section.rstrip("\n") == markdown_table(SETTINGS)
    assert all(f"| `{s.name}`" in section or f"`{s.flag_name}" in section for s in SETTINGS)


# -- links ---------------------------------------------------------------------------------------
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def _prose(text: str) -> str:
    """The text a reader sees as prose: fenced blocks and code spans are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, markup and punctuation other than
    ``-`` and ``_`` dropped, each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated heading gets -1, -2... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]


def test_slugs_are_githubs() -> None:
    assert slug("Data plane: `make bench`") == "data-plane-make-bench"
    assert slug("AWS S3 — `s3://bucket/prefix`") == "aws-s3--s3bucketprefix"
    assert slug("Small files (issue 32, item 4), 2026-12-05") == "small-files-issue-32-item-4-2026-12-05"
    assert slug("Peers: marinfs against rclone mount, s3fs-fuse and fsspec.fuse") == \
        "peers-marinfs-against-rclone-mount-s3fs-fuse-and-fsspecfuse"


def broken_links(page: Path) -> list[str]:
    """The relative links (and images) of a page that name no file, or a ``#anchor`` that is no
    heading of its target (or of the page itself)."""
    broken = []
    for link in relative_links(page):
        target, _, anchor = link.partition("#")
        dest = (page.parent / target).resolve() if target else page
        if not dest.exists():
            broken.append(f"{link}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{link}: no heading with that anchor in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_relative_link_is_broken(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_finds_broken_links(tmp_path: Path) -> None:
    """Not vacuous: a missing file and a missing anchor are found; code is not a link."""
    (tmp_path / "other.md").write_text("# Other\n\n## A heading, twice\n\n## A heading, twice\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nsee [a](missing.md), ![b](img/x.png \"t\"), [c](https://e.org/z),\n"
                    "`[d](in-code.md)`, [e](other.md#a-heading-twice-1), [f](other.md#nowhere), [g](#page),\n"
                    "[h](#gone)\n\n```\n[i](in-fence.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "img/x.png: no such file",
                                  "other.md#nowhere: no heading with that anchor in other.md",
                                  "#gone: no heading with that anchor in page.md"]
    assert sum(len(relative_links(p)) for p in PAGES) > 50


def test_the_benchmarks_page_holds_todays_numbers_within_40_kb() -> None:
    """docs/benchmarks.md is the method, the latest tables and how to rerun; dated session
    write-ups go, verbatim, to docs/benchmarks-notebook.md once newer numbers replace them."""
    size = (ROOT / "docs/benchmarks.md").stat().st_size
    assert size <= 40_000, f"docs/benchmarks.md is {size:,} bytes: move older sessions to the notebook"
    assert "benchmarks-notebook.md" in (ROOT / "docs/benchmarks.md").read_text()
