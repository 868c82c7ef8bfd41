"""The architecture specification the code cites (``spec §x.y``) is in the repository, and every
section the code cites is a heading of it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "ZAYA1_SPEC.md"


def _headings() -> set[str]:
    """Section numbers of the spec's headings: '## 2. Forward pass' -> '2', '### 2.3 CCA' -> '2.3'."""
    numbers = set()
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        match = re.match(r"#{2,4}\s+(\d+(?:\.\d+)*)\.?\s", line)
        if match:
            numbers.add(match.group(1))
    return numbers


def _citations() -> dict[str, list[str]]:
    cited: dict[str, list[str]] = {}
    for path in sorted((ROOT / "zaya_jax").rglob("*.py")):
        for number in re.findall(r"§(\d+(?:\.\d+)*)", path.read_text(encoding="utf-8")):
            cited.setdefault(number, []).append(str(path.relative_to(ROOT)))
    return cited


def test_every_cited_spec_section_is_a_heading_of_the_spec_in_the_repository():
    headings, cited = _headings(), _citations()
    assert {"1", "2", "2.3", "6.3", "7"} <= headings  # the parser reads the spec's numbering
    assert len(cited) >= 8  # the model cites its sections
    missing = {number: files for number, files in cited.items() if number not in headings}
    assert not missing, f"cited sections absent from docs/ZAYA1_SPEC.md: {missing}"
