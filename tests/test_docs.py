"""The user-facing documents speak of the project alone: no work sessions, no issue numbers, no
borrowed machines, no tool folders. Scans docs/*.md, README.md and the Makefile line by line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Word boundaries keep ordinary words out: "silent" and "talent" are not "lent", and
# "pre_session" (in a name, "_" being a word character) is not "session".
FORBIDDEN = {
    "session": re.compile(r"\bsession", re.IGNORECASE),
    "issue number": re.compile(r"\bissues?\s*(#|\d)", re.IGNORECASE),
    "lent": re.compile(r"\blent\b", re.IGNORECASE),
    "$OUT": re.compile(r"\$\{?OUT\b"),
}


def scanned_files() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "Makefile"]


def hits(path: Path) -> list[str]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for name, pattern in FORBIDDEN.items():
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: [{name}] {line.strip()}")
    return found


def test_the_scanned_files_exist_and_exclude_this_test():
    files = scanned_files()
    assert all(f.is_file() for f in files), [str(f) for f in files if not f.is_file()]
    assert len(files) > 2, "no docs/*.md found"
    assert Path(__file__).resolve() not in files


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("one H200 lent for a session", "lent"),
        ("Lent to us", "lent"),
        ("the second Session", "session"),
        ("sessions of work", "session"),
        ("(issue #48)", "issue number"),
        ("Targets (issue 44):", "issue number"),
        ("since issues 41-43 added tests", "issue number"),
        ("logs under $OUT", "$OUT"),
        ("logs under ${OUT}/x", "$OUT"),
    ],
)
def test_each_pattern_finds_what_it_is_for(text, name):
    assert FORBIDDEN[name].search(text)


@pytest.mark.parametrize(
    "text",
    [
        "a silent failure",
        "talent and excellent",
        "lentil",
        "the pre_session hook",
        "an issue with the tokenizer",
        "OUTPUT tokens and $OUTPUT",
        "the output folder OUT=/tmp/x",
    ],
)
def test_no_pattern_finds_ordinary_words(text):
    assert not [name for name, pattern in FORBIDDEN.items() if pattern.search(text)]


@pytest.mark.parametrize("path", scanned_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_document_speaks_of_the_project_alone(path):
    found = hits(path)
    assert not found, "\n".join(["words about work sessions, issues or tools:", *found])


def script_files() -> list[Path]:
    return sorted(p for p in (ROOT / "scripts").rglob("*") if p.suffix in (".py", ".sh"))


@pytest.mark.parametrize("path", script_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_script_cites_no_issue_number(path):
    """Scripts name what they measure, not the tracker entry that asked for it (their own
    variables, such as an output folder or a Unix session, are theirs to name)."""
    pattern = FORBIDDEN["issue number"]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if pattern.search(line)]
    assert not found, "\n".join(found)
