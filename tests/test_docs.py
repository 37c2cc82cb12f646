"""The docs cite tests by name: every name they cite exists, and every fault, bad-input and
security test (and every cell of the fault matrix) is in docs/reliability.md's tables."""

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
    `python -m marinfs.settings` when a setting changes."""
    from marinfs.config import SETTINGS
    from marinfs.settings import markdown_table

    text = (ROOT / "docs/usage.md").read_text()
    begin = text.index("<!-- settings table:")
    section = text[text.index("\n", begin) + 1:text.index("<!-- end of settings table -->")]
    assert section.rstrip("\n") == markdown_table(SETTINGS)
    assert all(f"| `{s.name}`" in section or f"`{s.flag_name}" in section for s in SETTINGS)
