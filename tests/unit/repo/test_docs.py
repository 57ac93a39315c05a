"""The README is the front door, each topic lives once in docs/, and every file named is there."""

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


# Paths in Miles' own repository that millstream's files cite (where a script or plugin was
# taken from): they are not ours, so they are not looked for here.
MILES_PATHS = {
    "scripts/run-qwen3-4B.sh", "scripts/run-moonlight-16B-A3B.sh", "scripts/models/qwen3-4B.sh",
    "examples/fully_async/run-qwen3-4b-fully_async.sh", "tests/test_gspo.sh",
    "examples/on_policy_distillation/run-qwen3-8B-opd-megatron.sh",
    "examples/ppo/run_qwen3_4b_ppo.py", "examples/train_infer_mismatch_helper/mis.py",
    "examples/infra_features/train_infer_mismatch_helper/mis.py",
    "docs/user-guide/customization.md",
    "tests/unit/test_a.py",  # a made-up node id in bench/gpu_rows.py's docstring
}  # fmt: skip
NAMED_PATH = re.compile(
    r"(?<![\w./-])((?:services|tests|docs|scripts|bench|examples|deploy|protos)/[\w./-]*\w"
    r"\.(?:py|md|sh|txt|yml|yaml|proto|json|jsonl|toml))"
)
OUTSIDE = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared\b")


def _tracked_text() -> Iterator[Path]:
    import subprocess

    names = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in names:
        path = REPO / name
        if path.suffix in {".py", ".md", ".sh", ".txt", ".toml", ".yml", ".yaml"} or (
            path.name == "Makefile"
        ):
            yield path


def test_every_file_a_file_names_is_in_the_repository():
    """A moved module or test leaves no path to where it was, in code, docs or scripts; and
    nothing points outside the repository (a design or style note the reader cannot open)."""
    missing, outside = [], []
    for path in _tracked_text():
        if not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and path != Path(__file__):
                outside.append(_where(path, lineno))
            for named in NAMED_PATH.findall(line):
                if named not in MILES_PATHS and not (REPO / named).exists():
                    missing.append(f"{_where(path, lineno)}: {named}")
    assert not outside, "points outside the repository:\n" + "\n".join(outside)
    assert not missing, "names a file that is not there:\n" + "\n".join(missing)


def test_the_readme_holds_one_table():
    """The README's one table is the comparison users make (against TRL and a plain loop);
    every other table lives with its topic in docs/."""
    tables = [lineno for lineno, _ in _tables(README)]
    assert len(tables) == 1, f"README.md has tables at lines {tables}: one, the rest in docs/"
