"""The size rules (docs/architecture.md, "Layers"): classes <= 300 lines, functions <= 60, files <= 400.

Enforced on vmcache/; bench/ and tests/ are measured too and what is over is
reported as a warning, not a failure. `python -m tests.unit.test_sizes` prints
every tree's list.
"""

from __future__ import annotations

import ast
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CLASS = 300
MAX_FUNCTION = 60
MAX_FILE = 400
ENFORCED = ("vmcache",)
REPORTED = ("bench", "tests")


@dataclass(frozen=True)
class Oversize:
    """One file, class or function over its limit."""

    path: str
    kind: str
    name: str
    lines: int
    limit: int

    def __str__(self) -> str:
        where = self.path if self.kind == "file" else f"{self.path} {self.kind} {self.name}"
        return f"{where}: {self.lines} lines > {self.limit}"


def measure(source: str, path: str) -> list[Oversize]:
    """Everything in one file's source over its limit (a class or function from its def line to its last)."""
    over = []
    lines = len(source.splitlines())
    if lines > MAX_FILE:
        over.append(Oversize(path, "file", path, lines, MAX_FILE))

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                kind, limit = ("class", MAX_CLASS) if isinstance(child, ast.ClassDef) else ("function", MAX_FUNCTION)
                if size > limit:
                    over.append(Oversize(path, kind, name, size, limit))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename=path), "")
    return over


def oversized(tree: str) -> list[Oversize]:
    """Everything over its limit in the Python files under ROOT/tree."""
    over = []
    for file in sorted((ROOT / tree).rglob("*.py")):
        over += measure(file.read_text(encoding="utf-8"), str(file.relative_to(ROOT)))
    return over


def test_vmcache_keeps_the_size_rules() -> None:
    """Every class, function and file in vmcache/ within its limit; bench/'s and tests/' excess is warned of."""
    for tree in REPORTED:
        for item in oversized(tree):
            warnings.warn(f"size rule: {item}", stacklevel=1)
    over = [str(item) for tree in ENFORCED for item in oversized(tree)]
    assert not over, "over the size rules:\n" + "\n".join(over)


def test_measure_finds_each_kind_at_its_limit() -> None:
    """The checker itself: a 61-line method in a 301-line class in a 401-line file is caught, 60 and 300 are not."""
    body = "\n".join(f"        x{i} = {i}" for i in range(59))
    method = f"    def long(self) -> None:\n{body}\n        pass\n"  # 61 lines
    fits = "    def fits(self) -> None:\n" + "\n".join(f"        y{i} = {i}" for i in range(59))  # 60
    filler = "\n".join(f"    z{i} = {i}" for i in range(300 - 1 - 61 - 60))
    source = f"class Big:\n{method}{fits}\n{filler}\n"  # 300 lines
    assert [str(o) for o in measure(source, "m.py")] == ["m.py function Big.long: 61 lines > 60"]
    source += "    w = 0\n" + "\n".join(f"v{i} = {i}" for i in range(100))  # the class 301, the file 401
    assert [(o.kind, o.name, o.lines) for o in measure(source, "m.py")] == [
        ("file", "m.py", 401), ("class", "Big", 301), ("function", "Big.long", 61)]


def main() -> int:
    """Print what is over in each tree; the exit status counts only vmcache/."""
    failed = 0
    for tree in ENFORCED + REPORTED:
        over = oversized(tree)
        print(f"{tree}/: {len(over)} over" + ("" if tree in ENFORCED else " (reported, not enforced)"))
        for item in over:
            print(f"  {item}")
        failed += len(over) if tree in ENFORCED else 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
