"""The README is the front door and each topic lives once in docs/ (STYLE.md item 13)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 250

LINK = re.compile(r"!?\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
TABLE_RULE = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")


def _where(path: Path, lineno: int) -> str:
    return f"{path.relative_to(REPO)}:{lineno}"


def _prose(path: Path) -> Iterator[tuple[int, str]]:
    """Lines outside fenced code blocks: a diagram or a shell session is no table or heading."""
    fenced = False
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield lineno, line


def _links(path: Path) -> Iterator[tuple[int, str]]:
    """Relative links (pages, images), without their #anchor; web links and anchors are skipped."""
    for lineno, line in _prose(path):
        for target in LINK.findall(CODE_SPAN.sub("code", line)):  # a link shown as code is none
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            yield lineno, target.split("#", 1)[0]


def _tables(path: Path) -> Iterator[tuple[int, str]]:
    """The header row of every table, cells stripped: two tables alike are one table twice."""
    lines = list(_prose(path))
    for (lineno, line), (_, rule) in itertools.pairwise(lines):
        if line.lstrip().startswith("|") and TABLE_RULE.match(rule.strip()):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            yield lineno, " | ".join(cells)


def _headings(path: Path) -> Iterator[tuple[int, str]]:
    for lineno, line in _prose(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            yield lineno, " ".join(match.group(1).split()).lower()


def test_readme_links_resolve():
    """A link from the front door that leads nowhere is the first thing a reader hits."""
    bad = [
        f"{_where(README, lineno)}: {target} does not exist"
        for lineno, target in _links(README)
        if not (REPO / target).exists()
    ]
    assert not bad, "\n".join(bad)


def test_every_doc_is_linked_from_the_readme():
    """Any topic is one click from the README, so a doc nobody links is a doc nobody reads."""
    linked = {(REPO / target).resolve() for _, target in _links(README)}
    assert DOCS, "docs/ holds no .md file"
    bad = [
        f"{doc.relative_to(REPO)} is not linked from README.md"
        for doc in DOCS
        if doc.resolve() not in linked
    ]
    assert not bad, "\n".join(bad)


def test_readme_stays_short():
    """The README says what, for whom, two commands, one picture, one table, links; the rest
    lives in docs/."""
    count = len(README.read_text().splitlines())
    assert count <= MAX_README_LINES, (
        f"README.md has {count} lines, {_where(README, MAX_README_LINES + 1)} on is over "
        f"the {MAX_README_LINES}: move a topic into docs/"
    )


def test_no_table_or_heading_is_stated_twice():
    """A table or section in two places drifts into two different sets of numbers."""
    seen_tables: dict[str, str] = {}
    seen_headings: dict[str, str] = {}
    bad = []
    for path in [README, *DOCS]:
        for lineno, header in _tables(path):
            first = seen_tables.setdefault(header, _where(path, lineno))
            if first != _where(path, lineno):
                bad.append(f"{_where(path, lineno)}: table header also at {first}: | {header} |")
        for lineno, heading in _headings(path):
            first = seen_headings.setdefault(heading, _where(path, lineno))
            if first != _where(path, lineno):
                bad.append(f"{_where(path, lineno)}: heading also at {first}: {heading}")
    assert not bad, "\n".join(bad)


def test_links_inside_docs_resolve():
    """docs/ names repository files by link; a file moved without its doc breaks one here."""
    bad = [
        f"{_where(doc, lineno)}: {target} does not exist"
        for doc in DOCS
        for lineno, target in _links(doc)
        if not (doc.parent / target).exists()
    ]
    assert not bad, "\n".join(bad)


def _gpu_tests() -> list[str]:
    """Every test that carries the gpu mark (on itself, its class or its module), by node id."""
    import ast

    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())

        def marked(node: ast.AST) -> bool:
            decorators = getattr(node, "decorator_list", [])
            return any("mark.gpu" in ast.unparse(d) for d in decorators)

        module = any(
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
            and "mark.gpu" in ast.unparse(n.value)
            for n in tree.body
        )
        rel = path.relative_to(REPO).as_posix()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                if module or marked(node):
                    found.append(f"{rel}::{node.name}")
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    is_test = isinstance(item, ast.FunctionDef) and item.name.startswith("test")
                    if is_test and (module or marked(node) or marked(item)):
                        found.append(f"{rel}::{node.name}::{item.name}")
    return found


def test_testing_md_lists_every_gpu_only_test():
    listed = (REPO / "docs" / "testing.md").read_text()
    gpu = _gpu_tests()
    assert len(gpu) >= 5, gpu
    missing = [t for t in gpu if f"`{t}`" not in listed]
    assert not missing, f"docs/testing.md (GPU-only tests) does not list {missing}"
