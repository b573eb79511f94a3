"""docs/architecture.md names only modules that exist, and names every module that exists.

Pure file reading: module names are resolved against the source tree (and attributes against the modules'
syntax trees), never by importing anything, so the test stays fast and loads no torch.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("orchestra", "agents", "mappings")
NOT_LISTED = {"__init__.py", "__main__.py"}
"""Module files the module map need not name (a package's own files, named when they matter)."""

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`([^`\n]+)`")
_ROOTS = "|".join(PACKAGES)
_PATH = re.compile(rf"^(?:{_ROOTS})(?:/[A-Za-z_][A-Za-z0-9_]*)*(?:\.py|/)$")
"""A path to a module file or a folder under one of the packages: `orchestra/serve/_runs.py`, `mappings/`."""
_DOTTED = re.compile(rf"^(?:{_ROOTS})(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
"""A dotted name: a module (`orchestra.familycache`) or an attribute of one (`agents.builtin.BUILTINS`)."""


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """(line number, content) of every inline code span outside fenced code blocks."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keep line numbers
    for number, line in enumerate(text.splitlines(), start=1):
        for match in _SPAN.finditer(line):
            yield number, match.group(1).strip()


def module_file(parts: tuple[str, ...]) -> Path | None:
    """The source file of the module `parts` names (a package's ``__init__.py``), or None."""
    base = REPO.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def _bound_names(statements: list[ast.stmt]) -> Iterator[str]:
    """Names a module binds at its top level (under ``if``/``try``/``with`` too): defs, classes, assignments,
    imports."""
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from ((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.If):
            yield from _bound_names(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _bound_names(node.body + node.orelse + node.finalbody
                                    + [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.With):
            yield from _bound_names(node.body)


@cache
def module_names(path: Path) -> frozenset[str]:
    """What `path`'s module offers as an attribute. A package's ``__init__.py`` also offers every identifier it
    names in a string (``__all__`` and the lazy name tables that ``__getattr__`` resolves)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set(_bound_names(tree.body))
    if path.name == "__init__.py":
        names |= {n.value for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier()}
    return frozenset(names)


@cache
def defined_anywhere(package: str) -> frozenset[str]:
    """Every function, class, method and assigned or annotated name in `package`'s source, at any depth (for the
    attribute of an attribute: `FamilyCache.acquire`)."""
    names: set[str] = set()
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return frozenset(names)


def resolve(token: str) -> tuple[bool, Path | None]:
    """Whether a path-like or dotted `token` names something that exists, and the module file it names (None for
    a folder, or when nothing matches)."""
    if _PATH.match(token):
        path = REPO / token
        if token.endswith("/"):
            return path.is_dir(), None
        return path.is_file(), path if path.is_file() else None
    parts = tuple(token.split("."))
    for k in range(len(parts), 0, -1):  # the longest prefix that is a module
        found = module_file(parts[:k])
        if found is None:
            continue
        rest = parts[k:]
        if not rest:
            return True, found
        if rest[0] not in module_names(found):
            return False, found
        return all(name in defined_anywhere(parts[0]) for name in rest[1:]), found
    return False, None


def checked_tokens(text: str) -> list[tuple[int, str]]:
    return [(line, token) for line, token in code_spans(text) if _PATH.match(token) or _DOTTED.match(token)]


def module_files() -> list[Path]:
    """Every module file of the three packages that the module map must name."""
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py")
                  if path.name not in NOT_LISTED and "__pycache__" not in path.parts)


def test_every_module_the_doc_names_exists() -> None:
    tokens = checked_tokens(DOC.read_text(encoding="utf-8"))
    assert len(tokens) > 100, "the doc's module names were not found: has the extraction broken?"
    gone = sorted({f"line {line}: {token}" for line, token in tokens if not resolve(token)[0]},
                  key=lambda s: int(s.split(":")[0].split()[1]))
    assert not gone, ("docs/architecture.md names modules, folders or attributes that do not exist (renamed or "
                      "removed? update the doc):\n" + "\n".join(gone))


def test_every_module_is_named_in_the_doc() -> None:
    named = {resolve(token)[1] for _, token in checked_tokens(DOC.read_text(encoding="utf-8"))}
    missing = [str(path.relative_to(REPO)) for path in module_files() if path not in named]
    assert not missing, ("modules without a line in docs/architecture.md (add each to the module map, as a path "
                         "in backticks, with what it owns):\n" + "\n".join(missing))


def test_the_checks_tell_real_names_from_gone_ones() -> None:
    """The resolver itself, on names that exist and names that do not."""
    text = "\n".join([
        "`orchestra/familycache/_core.py` `mappings/` `orchestra.familycache` `agents.builtin.BUILTINS`",
        "`orchestra.familycache.FamilyCache` `orchestra.familycache.FamilyCache.acquire_sync` `mappings.apply`",
        "```", "`orchestra/in_a_fence.py`", "```",
        "`orchestra/gone.py` `agents/gone/` `orchestra.gone` `mappings.apply.no_such_function`",
        "`orchestra run` `orchestra-kv[ray]` `PipelineSpec`",
    ])
    tokens = checked_tokens(text)
    assert [t for _, t in tokens if not resolve(t)[0]] == [
        "orchestra/gone.py", "agents/gone/", "orchestra.gone", "mappings.apply.no_such_function"]
    assert len(tokens) == 11  # the fenced one and the non-module spans are not checked
    assert resolve("agents.builtin.BUILTINS")[1] == REPO / "agents" / "builtin.py"
    assert resolve("orchestra.familycache")[1] == REPO / "orchestra" / "familycache" / "__init__.py"
