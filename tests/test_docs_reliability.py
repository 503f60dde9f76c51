"""docs/reliability.md names, for each threat, the test that fails if its defence
goes: every test it names must exist, so the page cannot point at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reliability.md"
# `test_x.py::test_name` names a file of tests/ (`numa/test_x.py`: one of tests/numa/, run in
# the NUMA guest); a following `::test_other` means the same file
REF = re.compile(r"`(?:((?:numa/)?test_\w+\.py))?::(test_\w+)(?:\[[^\]`]*\])?`")


def named_tests() -> list[tuple[str, str, int]]:
    out = []
    for lineno, line in enumerate(PAGE.read_text().splitlines(), 1):
        current = None
        for m in REF.finditer(line):
            current = m.group(1) or current
            assert current, f"reliability.md:{lineno}: `::{m.group(2)}` with no test file before it"
            out.append((current, m.group(2), lineno))
    return out


def test_the_page_names_tests():
    assert len(named_tests()) >= 30


def test_every_test_the_page_names_exists():
    missing = []
    for filename, name, lineno in named_tests():
        path = ROOT / "tests" / filename
        text = path.read_text() if path.exists() else ""
        if not re.search(rf"^def {name}\(", text, re.M):
            missing.append(f"reliability.md:{lineno}: tests/{filename}::{name}")
    assert not missing, "\n".join(missing)
