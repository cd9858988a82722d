"""The README is a front door and docs/ holds the guides: every relative link resolves (file and,
for markdown targets, heading anchor), the README links every guide, and the README's headline
table is the one docs/benchmarks.md documents (no figure lives only in the README)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", flags=re.S | re.M)


def _markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("recipes", "benchmarks/results"):
        files += sorted((ROOT / folder).rglob("*.md"))
    return [*files, ROOT / "benchmarks" / "README.md"]


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lowercase, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(path.read_text()))]


def test_slug_matches_github():
    assert _slug("How it compares (measured)") == "how-it-compares-measured"
    assert _slug("Measured quality (Qwen3 presets, `python benchmarks/planner_quality.py`)") == (
        "measured-quality-qwen3-presets-python-benchmarksplanner_qualitypy")


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md: Path):
    broken = []
    for target in _links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (md.parent / file).resolve() if file else md
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{md.relative_to(ROOT)}: {broken}"


def test_readme_links_every_guide_and_stays_a_front_door():
    readme = ROOT / "README.md"
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(readme) if not t.startswith("#")}
    guides = sorted((ROOT / "docs").glob("*.md"))
    assert guides, "docs/ holds the guides"
    missing = [g.name for g in guides if g.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"
    n = len(readme.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines: move reference material to docs/"


def test_readme_headline_table_is_the_documented_one():
    """Every table row of the README is in a docs page verbatim, so the README invents nothing."""
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md")).splitlines()
    rows = [l for l in (ROOT / "README.md").read_text().splitlines()
            if l.startswith("|") and not l.startswith("|---") and "](docs/" not in l and l != "| page | what it holds |"]
    assert rows, "the README shows the headline comparison"
    missing = [r for r in rows if r not in docs]
    assert not missing, missing
