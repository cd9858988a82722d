"""``[Note: ...]`` blocks hold the cross-cutting invariants (DEVELOPERS.md); a reference to one must
lead to it. A Note is *defined* where its name opens a line of a comment or docstring (``# [Note:
X] ...``, ``\"\"\"[Note: X] ...`` or a line ``[Note: X]``) in the code, and *referenced* anywhere
else (code or docs), optionally with the file that defines it: ``[Note: X] in ``path````.

Pinned: every Note is defined once; every reference names a defined Note; a reference that names
a file names the one that defines it (a Note moved with its code must take its references along)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = r"\[Note: ([^\]]+)\]"
# a line of its own or opening a docstring's paragraph (a capital follows), or opening a comment or
# docstring and not followed by
# what a reference that wrapped to a line's start is ("(in file)", " in file", ")", ",", ":", ".")
DEFINITION = re.compile(r"^\s*" + NAME + r"(?:\s*$|\s+[A-Z])|^\s*(?:#\s*|r?\"\"\")" + NAME + r"(?!\s*\(?in\s|[),:.])")
REFERENCE = re.compile(NAME + r"(?:\)?,?\s*\(?in\s+`{0,2}([\w/.]+\.(?:py|md))`{0,2})?")


def _files() -> list[Path]:
    files = [p for folder in ("src", "tests", "benchmarks", "docs", "recipes") for p in (ROOT / folder).rglob("*")
             if p.suffix in (".py", ".md") and p.name != Path(__file__).name]
    return sorted(files) + [ROOT / "README.md", ROOT / "DEVELOPERS.md"]


def _scan() -> tuple[dict[str, list[str]], list[tuple[str, str, str | None]]]:
    defined: dict[str, list[str]] = {}
    refs: list[tuple[str, str, str | None]] = []
    for path in _files():
        rel = str(path.relative_to(ROOT))
        for n, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            d = DEFINITION.match(line) if path.suffix == ".py" else None
            if d:
                defined.setdefault(d.group(1) or d.group(2), []).append(rel)
            for m in REFERENCE.finditer(line):
                if d and m.start() == line.index("[Note:"):
                    continue
                refs.append((f"{rel}:{n}", m.group(1), m.group(2)))
    return defined, refs


def test_every_note_is_defined_once_and_every_reference_leads_to_it():
    defined, refs = _scan()
    assert len(defined) > 50, "the scan found almost no Notes: the definition pattern is broken"
    twice = {name: files for name, files in defined.items() if len(files) > 1}
    assert not twice, f"Notes defined more than once: {twice}"
    undefined = [(where, name) for where, name, _ in refs if name not in defined]
    assert not undefined, f"references to Notes defined nowhere: {undefined}"
    wrong = [(where, name, f"says {file}, defined in {defined[name][0]}") for where, name, file in refs
             if file is not None and not defined[name][0].endswith(file)]
    assert not wrong, f"references naming the wrong file: {wrong}"


def test_the_patterns_tell_definitions_from_references():
    assert DEFINITION.match("    # [Note: host step counts] Shampoo's and SOAP's schedules")
    assert DEFINITION.match('    """[Note: CPU offload] FSDP2\'s ``CPUOffloadPolicy`` keeps')
    assert DEFINITION.match("[Note: update-rule protocol]")
    assert DEFINITION.match("    [Note: cap slack] Strict caps can cost the balance a lot")
    assert DEFINITION.match("    # [Note: batched Muon] the per-matrix op sequence")
    assert not DEFINITION.match("    [Note: atomic save]); each owned tensor is written once")
    assert not DEFINITION.match("    # [Note: torch's loaders] (in _compat.py): the two")
    assert not DEFINITION.match("    [Note: routing invariant] in ``planner/rules.py``).")
    m = REFERENCE.search("see [Note: state on the shards] in ``optim/rule.py``")
    assert m and m.groups() == ("state on the shards", "optim/rule.py")
