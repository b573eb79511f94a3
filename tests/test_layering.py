"""The import layering, written down as import-linter contracts (pyproject ``[tool.importlinter]``).

`lint-imports` checks that imports flow orchestra -> agents -> mappings, that the runtime modules
never reach the family build/training code, the benchmarks or build-only libraries (peft, gguf,
matplotlib), and that the modules of mappings and agents import each other without cycles. The
grimp check below repeats the cycle rule module by module (import-linter's acyclic contract
compares sibling subpackages), counting imports inside functions and under TYPE_CHECKING: a
lazy import is still a dependency.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.waiting import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
ACYCLIC = ("mappings", "agents", "orchestra")


def _lint_imports() -> Path:
    """The `lint-imports` script of the interpreter running the tests (not whatever is on PATH)."""
    name = "lint-imports.exe" if sys.platform == "win32" else "lint-imports"
    for folder in (Path(sysconfig.get_path("scripts")), Path(sys.executable).parent):
        if (folder / name).is_file():
            return folder / name
    pytest.fail("lint-imports is not installed: pip install -e '.[dev]'")


def test_import_contracts_are_kept():
    done = subprocess.run([str(_lint_imports()), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.returncode == 0, f"lint-imports failed:\n{done.stdout}\n{done.stderr}"


def _cycles(graph, package: str) -> list[list[str]]:
    """Strongly connected groups (> 1 module) of ``package``'s modules, the package itself included."""
    modules = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in modules and i != m)
             for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(m: str) -> None:  # Tarjan; the packages are small enough for recursion
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in edges[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                group.append(n)
                if n == m:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return groups


def _describe(graph, group: list[str]) -> str:
    lines = []
    for a in group:
        for b in group:
            if a != b and graph.direct_import_exists(importer=a, imported=b):
                where = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
                lines.append(f"  {a} -> {b} (line {', '.join(map(str, where))})")
    return "\n".join(lines)


def test_no_import_cycles_between_modules():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("mappings", "agents", "orchestra", exclude_type_checking_imports=False)
    found = {package: _cycles(graph, package) for package in ACYCLIC}
    report = "\n".join(f"{package}: {group}\n{_describe(graph, group)}"
                       for package, groups in found.items() for group in groups)
    assert not report, f"import cycles (lazy and TYPE_CHECKING imports count):\n{report}"
