"""The docs state current facts; provenance lives in the results files.

Every page under ``docs/`` and the README names the machine, the command and the results file of
a figure; the commit and the date of a run are in that file (``benchmarks/results/*.json`` and
``.txt``, the generators' JSON next to their pages, or ``benchmarks/results/docs-provenance.md``
for figures measured without one), never in the pages' prose. ``docs/benchmarks.md`` holds the
current figures only (earlier rounds: ``benchmarks/results/history-benchmarks.md``), so it stays
short.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A commit hash as written in prose or in a file name: 7 to 40 lowercase hex digits as a whole word
# (not the tail of 0x..., not part of an identifier), with at least one letter a-f and one digit,
# so that plain numbers (1048576) and words are not taken for one.
HASH = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?!\w)")
# "commit 1234567": a hash of digits only, named as a commit.
NAMED_HASH = re.compile(r"\bcommits?\s+`?[0-9]{7,40}\b", re.IGNORECASE)
# An ISO date (alone or as the start of a date-time).
DATE = re.compile(r"(?<!\d)(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?!\d)")
MAX_BENCHMARKS_LINES = 300


def _pages() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def _offences(text: str) -> list[str]:
    """Every commit hash or ISO date in ``text``, in order."""
    found: list[tuple[int, str]] = []
    for pattern in (HASH, NAMED_HASH, DATE):
        found += [(m.start(), m.group(0)) for m in pattern.finditer(text)]
    return [s for _, s in sorted(found)]


@pytest.mark.parametrize("text", [
    "commit d682121, 2026-11-28 11:25-11:27 UTC;",
    "at commit `7129eeb66baa` on 2026-11-24 (x86_64 CPU)",
    "Commit measured: 2442e32 (+ uncommitted changes).",
    "the tree of commit 7b9d894 (the half-zero bits sent: 1a33024)",
    "commits d8456c6 to e97e01b",
    "full hash 061bf9f96d6338a24fce169f172d9fc28866c13c here",
    "commit 1234567 (digits only)",
    "`benchmarks/results/fsdp-1gbit-4-061bf9f.json`",
    "date_utc 2026-11-29T09:14:43Z",
])
def test_hashes_and_dates_are_found(text: str) -> None:
    """The check finds the commit hashes and dates that provenance sentences used to carry."""
    assert _offences(text)


@pytest.mark.parametrize("text", [
    "bf16 fp16 fp8e4m3 mxfp8 int4_block 2^24 12 582 912 coordinates",
    "1048576 4194304 16777216 22713216 coordinates, 9263125 bytes",
    "mask 0x7fffffff and 0xdeadbeef1234, sm_90, cuda12x",
    "vNMSE 1.11e-2, 3.9-4.4e-7, 1e-04, 2.36x, 98.56 / 21.89 (4.41x)",
    "`dqcoll simulate --world-size 8192`; `simulate-n1024-butterfly-dynamiq6.json`",
    "ranks 0-3, steps 10-20, 2x2 hosts, 2026 coordinates, 11:25 UTC",
])
def test_ordinary_words_and_numbers_are_not_flagged(text: str) -> None:
    """Numbers, dtype names, hex constants and file names are not taken for hashes or dates."""
    assert _offences(text) == []


def test_no_page_carries_a_commit_hash_or_a_date() -> None:
    """No line of docs/**/*.md or README.md names a commit hash or an ISO date: the machine, the
    command and the results file are in the prose, the commit and the date in the file."""
    offences = []
    for page in _pages():
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            found = _offences(line)
            if found:
                offences.append(f"{page.relative_to(ROOT)}:{number}: {found}")
    assert offences == [], "\n".join(offences)


def test_benchmarks_page_is_at_most_300_lines() -> None:
    """docs/benchmarks.md holds the current figures only, in at most 300 lines."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_BENCHMARKS_LINES


def test_results_files_named_by_the_docs_exist() -> None:
    """Every file under benchmarks/results/ that a page's prose names as its source exists
    (brace lists expanded), so a rename leaves no page pointing at nothing. Commands in code
    blocks name the files they would write, and "to be recorded" lines files not yet made."""
    missing = []
    name = re.compile(r"benchmarks/results/([\w.{},-]+\.(?:json|txt|md|png))")
    for page in _pages():
        for ref in name.findall(_prose(page.read_text(encoding="utf-8"))):
            for path in _expand(ref):
                if not (ROOT / "benchmarks" / "results" / path).exists():
                    missing.append(f"{page.relative_to(ROOT)}: benchmarks/results/{path}")
    assert missing == [], "\n".join(missing)


def _expand(ref: str) -> list[str]:
    """``a-{x,y}-b{1,2}.json`` -> the four names (no nesting)."""
    match = re.search(r"\{([^{}]*)\}", ref)
    if not match:
        return [ref]
    head, tail = ref[: match.start()], ref[match.end():]
    return [name for part in match.group(1).split(",") for name in _expand(head + part + tail)]


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and without lines saying "to be recorded"."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and "to be recorded" not in line:
            kept.append(line)
    return "\n".join(kept)
