"""The README's promises about itself: CI runs exactly its test command, and its links resolve.

The README says `.ci/run` runs exactly command 2; a change to either that the other does not
follow would make the README lie about what CI checks. Its relative links (docs/, source files,
images) must name files that exist, since the record moved from the README into docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M)


def test_ci_runs_exactly_the_readme_test_command():
    block = fenced_blocks(README.split("## ", 1)[0])[-1]  # the two commands, above the first section
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands
    quickstart, tests = commands
    assert "dreamgym train" in quickstart
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert any(line == tests or line.startswith(tests + " ") for line in ci), (tests, ci)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6} (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_every_relative_link_resolves():
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    relative = [link for link in links if not re.match(r"^[a-z]+:", link)]
    assert len(relative) >= 5, relative  # the docs links are there at all
    for link in relative:
        path, _, fragment = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {link}, which does not exist"
        if fragment and target.suffix == ".md":
            assert fragment in anchors(target), f"README links to {link}: no such heading"
