"""Code-health counts over the runtime packages: `Any` annotations, long functions, private imports, sync/async crossings.

    python scripts/code_health.py [--root DIR] [--json] [--check] [--max-any N]

Over ``orchestra/``, ``agents/`` and ``mappings/`` (tests and benchmarks aside) it reports:

- ``Any`` in annotations: every ``Any`` / ``typing.Any`` inside an argument or return annotation, an
  annotated assignment or a module-level type alias (``X = dict[str, Any]``, ``X: TypeAlias = ...``);
  ``Any`` in a string or inside a call (``cast(Any, x)``) is not an annotation and is not counted;
- functions (methods and nested ones included) longer than 60 lines, ``end_lineno - lineno + 1`` from
  the ``def`` line; typer commands (decorated ``@<app>.command``) are listed apart, since most of their
  length is the option list of their signature;
- private imports across packages: ``from X import _name``, ``import X._mod`` or ``from X._mod import y``
  where X's top-level package is another of the three; and, from ``benchmarks/*.py``, any private name
  or module of the three packages or any name of ``orchestra.bench`` outside its ``__all__`` (the
  benchmarks use the public API of ``orchestra.bench``);
- sync/async crossings: the call sites where work passes between an event loop and a thread, found in
  the AST: ``anyio.to_thread.run_sync``, ``anyio.from_thread.run``, ``anyio.from_thread.run_sync``,
  ``anyio.run``, ``asyncio.run``, ``asyncio.run_coroutine_threadsafe``, any ``.run_in_executor(...)``,
  ``threading.Thread(...)`` and ``ThreadStream(...)`` (the one bridge, ``agents.bridge``; any callee named
  so, ``ThreadStream[T, R](...)`` too). A callee is resolved through the file's imports, so
  ``from anyio.to_thread import run_sync``, ``import anyio.to_thread as tt`` or ``from threading import
  Thread`` count as the dotted call does, and a ``run`` imported from elsewhere does not. Reported in
  total, per kind and per file (top files). The packages cross through the bridge's helpers
  (``in_thread``, ``run_blocking``, ``call_in_loop``, ``start_thread``, ``ThreadStream``), so nearly all
  of them stand in ``agents/bridge.py``.

``--check`` exits 1, with a one-line reason, when any function (typer commands aside) is over 60 lines,
any private import crosses packages, there are 10 or more sync/async crossings, or the ``Any`` count
exceeds ``--max-any`` (default 150; a negative value leaves ``Any`` unchecked). Otherwise the exit status
is 0.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

PACKAGES = ("orchestra", "agents", "mappings")
BENCH_PACKAGE = "orchestra.bench"
MAX_LINES = 60
MAX_LONG_FUNCTIONS = 0
DEFAULT_MAX_ANY = 150
TOP_ANY_FILES = 10
TOP_CROSSING_FILES = 10
MAX_CROSSINGS = 9
"""At most this many sync/async crossings: one bridge (`agents.bridge`) and the few uses of its stream."""

CROSSING_CALLS = (
    "anyio.to_thread.run_sync",
    "anyio.from_thread.run",
    "anyio.from_thread.run_sync",
    "anyio.run",
    "asyncio.run",
    "asyncio.run_coroutine_threadsafe",
    "threading.Thread",
)
"""Fully qualified callees that cross between an event loop and a thread."""
RUN_IN_EXECUTOR = ".run_in_executor"
"""Any method call of this name (``loop.run_in_executor(...)``), whatever its receiver."""
THREAD_STREAM = "ThreadStream"
"""Any callee of this name (the bridge's class), however it was imported."""
CROSSING_KINDS = (*CROSSING_CALLS, RUN_IN_EXECUTOR, THREAD_STREAM)


@dataclass(frozen=True)
class LongFunction:
    path: str
    line: int
    name: str
    lines: int


@dataclass(frozen=True)
class PrivateImport:
    path: str
    line: int
    statement: str
    reason: str


@dataclass(frozen=True)
class Crossing:
    path: str
    line: int
    kind: str


@dataclass
class Report:
    any_total: int = 0
    any_by_file: dict[str, int] = field(default_factory=dict)
    long_functions: list[LongFunction] = field(default_factory=list)
    typer_commands: list[LongFunction] = field(default_factory=list)
    private_imports: list[PrivateImport] = field(default_factory=list)
    benchmark_imports: list[PrivateImport] = field(default_factory=list)
    crossings: list[Crossing] = field(default_factory=list)

    def top_any_files(self) -> list[tuple[str, int]]:
        return Counter(self.any_by_file).most_common(TOP_ANY_FILES)

    def crossings_by_kind(self) -> dict[str, int]:
        """Every kind of crossing (zeros included, in `CROSSING_KINDS` order) and its count."""
        counts = Counter(c.kind for c in self.crossings)
        return {kind: counts[kind] for kind in CROSSING_KINDS}

    def top_crossing_files(self) -> list[tuple[str, int]]:
        return Counter(c.path for c in self.crossings).most_common(TOP_CROSSING_FILES)

    def to_json(self) -> dict[str, object]:
        return {
            "any_total": self.any_total,
            "any_top_files": [{"path": p, "count": n} for p, n in self.top_any_files()],
            "long_functions": [asdict(f) for f in self.long_functions],
            "typer_commands": [asdict(f) for f in self.typer_commands],
            "private_imports": [asdict(i) for i in self.private_imports],
            "benchmark_imports": [asdict(i) for i in self.benchmark_imports],
            "crossings": {
                "total": len(self.crossings),
                "by_kind": self.crossings_by_kind(),
                "top_files": [{"path": p, "count": n} for p, n in self.top_crossing_files()],
            },
        }


# --- `Any` in annotations -------------------------------------------------------------------------------

def _is_any(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "Any"
    return (isinstance(node, ast.Attribute) and node.attr == "Any"
            and isinstance(node.value, ast.Name) and node.value.id in ("typing", "t"))


def count_any(annotation: ast.AST | None) -> int:
    """`Any` names in one annotation; calls (``Field(...)`` in ``Annotated``) and strings are skipped."""
    if annotation is None:
        return 0
    if _is_any(annotation):
        return 1
    if isinstance(annotation, (ast.Call, ast.Constant)):
        return 0
    return sum(count_any(child) for child in ast.iter_child_nodes(annotation))


def _is_type_expression(node: ast.AST) -> bool:
    """A module-level value that reads as a type alias: ``dict[str, Any]``, ``A | B``, ``Any``."""
    if isinstance(node, ast.Subscript) or _is_any(node):
        return True
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr)


def _is_type_alias_annotation(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "TypeAlias") or (
        isinstance(node, ast.Attribute) and node.attr == "TypeAlias")


def _annotations(tree: ast.Module) -> list[ast.AST]:
    """Every annotation of a module, plus the values of its module-level type aliases."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and arg.annotation is not None:
                    found.append(arg.annotation)
            if node.returns is not None:
                found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
            if _is_type_alias_annotation(node.annotation) and node.value is not None:
                found.append(node.value)
        elif type(node).__name__ == "TypeAlias":  # `type X = ...` (Python 3.12+)
            found.append(node.value)  # type: ignore[attr-defined]
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and _is_type_expression(stmt.value):
            found.append(stmt.value)
    return found


# --- long functions --------------------------------------------------------------------------------------

def _is_typer_command(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "command":
            return True
    return False


def _long_functions(tree: ast.Module, path: str, report: Report) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines <= MAX_LINES:
            continue
        entry = LongFunction(path, node.lineno, node.name, lines)
        (report.typer_commands if _is_typer_command(node) else report.long_functions).append(entry)


# --- private imports -------------------------------------------------------------------------------------

def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module(module: str) -> bool:
    return any(_is_private(part) for part in module.split("."))


def _imports(tree: ast.Module) -> list[tuple[int, str, list[str], str]]:
    """(line, module, imported names, source text) of every absolute import, lazy ones included."""
    found: list[tuple[int, str, list[str], str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            found.append((node.lineno, node.module, names, f"from {node.module} import {', '.join(names)}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, [], f"import {alias.name}"))
    return found


def _cross_package_private(tree: ast.Module, path: str, own_package: str, report: Report) -> None:
    for line, module, names, text in _imports(tree):
        top = module.split(".")[0]
        if top not in PACKAGES or top == own_package:
            continue
        private_names = [n for n in names if _is_private(n)]
        if _private_module(module) or private_names:
            what = "private module" if _private_module(module) else f"private name {', '.join(private_names)}"
            report.private_imports.append(PrivateImport(path, line, text, f"{own_package} -> {top}: {what}"))


def _public_names(init: Path) -> set[str] | None:
    """The literal ``__all__`` of a package ``__init__``, or None where it has none."""
    if not init.is_file():
        return None
    for stmt in ast.parse(init.read_text(encoding="utf-8")).body:
        if (isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets)
                and isinstance(stmt.value, (ast.List, ast.Tuple))):
            return {e.value for e in stmt.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return None


def _benchmark_imports(tree: ast.Module, path: str, bench_api: set[str] | None, report: Report) -> None:
    for line, module, names, text in _imports(tree):
        if module.split(".")[0] not in PACKAGES:
            continue
        private_names = [n for n in names if _is_private(n)]
        if _private_module(module) or private_names:
            reason = "private module" if _private_module(module) else f"private name {', '.join(private_names)}"
        elif module.startswith(BENCH_PACKAGE + "."):
            reason = f"submodule of {BENCH_PACKAGE}: import from {BENCH_PACKAGE} itself"
        elif module == BENCH_PACKAGE and bench_api is not None and set(names) - bench_api:
            reason = f"not in {BENCH_PACKAGE}.__all__: {', '.join(sorted(set(names) - bench_api))}"
        else:
            continue
        report.benchmark_imports.append(PrivateImport(path, line, text, reason))


# --- sync/async crossings -------------------------------------------------------------------------------

def _import_aliases(tree: ast.Module) -> dict[str, str]:
    """The dotted name each name bound by an absolute import stands for, lazy imports included (one map per
    file: scopes are not told apart). ``import a.b`` binds ``a``; ``import a.b as c`` binds ``c`` to ``a.b``."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if alias.name != "*":
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` of a callee made of names and attributes, its first name resolved through the imports."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(attrs)])


def crossing_kind(call: ast.Call, aliases: dict[str, str]) -> str | None:
    """The kind of crossing a call is (one of `CROSSING_KINDS`), or None."""
    func = call.func
    while isinstance(func, ast.Subscript):  # ThreadStream[T, R](...)
        func = func.value
    if isinstance(func, ast.Attribute) and func.attr == RUN_IN_EXECUTOR[1:]:
        return RUN_IN_EXECUTOR
    last = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if last == THREAD_STREAM:
        return THREAD_STREAM
    name = _dotted(func, aliases)
    return name if name in CROSSING_CALLS else None


def _crossings(tree: ast.Module, path: str, report: Report) -> None:
    aliases = _import_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            kind = crossing_kind(node, aliases)
            if kind is not None:
                report.crossings.append(Crossing(path, node.lineno, kind))


# --- the scan --------------------------------------------------------------------------------------------

def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def scan(root: Path) -> Report:
    report = Report()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = _parse(path)
            n_any = sum(count_any(a) for a in _annotations(tree))
            if n_any:
                report.any_by_file[rel] = n_any
                report.any_total += n_any
            _long_functions(tree, rel, report)
            _cross_package_private(tree, rel, package, report)
            _crossings(tree, rel, report)
    bench_api = _public_names(root / Path(*BENCH_PACKAGE.split(".")) / "__init__.py")
    for path in sorted((root / "benchmarks").glob("*.py")):
        _benchmark_imports(_parse(path), path.relative_to(root).as_posix(), bench_api, report)
    for entries in (report.long_functions, report.typer_commands):
        entries.sort(key=lambda f: (-f.lines, f.path, f.line))
    report.crossings.sort(key=lambda c: (c.path, c.line, c.kind))
    return report


def failures(report: Report, max_any: int) -> list[str]:
    """Reasons the thresholds fail; empty when they hold. ``max_any < 0`` leaves `Any` unchecked."""
    reasons: list[str] = []
    if len(report.long_functions) > MAX_LONG_FUNCTIONS:
        reasons.append(f"{len(report.long_functions)} functions over {MAX_LINES} lines (max {MAX_LONG_FUNCTIONS})")
    crossing = len(report.private_imports) + len(report.benchmark_imports)
    if crossing:
        reasons.append(f"{crossing} private imports across packages (max 0)")
    if len(report.crossings) > MAX_CROSSINGS:
        reasons.append(f"{len(report.crossings)} sync/async crossings (max {MAX_CROSSINGS}): cross through the "
                       "helpers of agents.bridge")
    if max_any >= 0 and report.any_total > max_any:
        reasons.append(f"{report.any_total} Any annotations (max {max_any})")
    return reasons


def render(report: Report) -> str:
    out = [
        f"{'metric':<46} {'count':>5}",
        f"{'Any annotations':<46} {report.any_total:>5}",
        f"{f'functions over {MAX_LINES} lines (typer commands aside)':<46} {len(report.long_functions):>5}",
        f"{'typer option lists over ' + str(MAX_LINES) + ' lines':<46} {len(report.typer_commands):>5}",
        f"{'private imports across packages':<46} {len(report.private_imports):>5}",
        f"{'benchmarks: non-public imports':<46} {len(report.benchmark_imports):>5}",
        f"{f'sync/async crossings (max {MAX_CROSSINGS})':<46} {len(report.crossings):>5}",
    ]
    if report.any_by_file:
        out += ["", "Any annotations, top files:"] + [f"  {n:>4}  {p}" for p, n in report.top_any_files()]
    if report.crossings:
        out += ["", "sync/async crossings by kind:"] + [
            f"  {n:>4}  {kind}" for kind, n in report.crossings_by_kind().items() if n]
        out += ["", "sync/async crossings, top files:"] + [f"  {n:>4}  {p}" for p, n in report.top_crossing_files()]
    for title, functions in ((f"functions over {MAX_LINES} lines:", report.long_functions),
                             ("typer option lists (may stay):", report.typer_commands)):
        if functions:
            out += ["", title] + [f"  {f.lines:>4}  {f.path}:{f.line}  {f.name}" for f in functions]
    for title, imports in (("private imports across packages:", report.private_imports),
                           ("benchmarks: non-public imports:", report.benchmark_imports)):
        if imports:
            out += ["", title] + [f"  {i.path}:{i.line}  {i.statement}  ({i.reason})" for i in imports]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="repository root holding orchestra/, agents/, mappings/ and benchmarks/")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--check", action="store_true", help="exit 1 when a threshold fails")
    parser.add_argument("--max-any", type=int, default=DEFAULT_MAX_ANY,
                        help=f"most `Any` annotations --check allows (default {DEFAULT_MAX_ANY}; negative: unchecked)")
    args = parser.parse_args(argv)
    report = scan(args.root)
    print(json.dumps(report.to_json(), indent=2) if args.json else render(report))
    if args.check:
        reasons = failures(report, args.max_any)
        if reasons:
            print("code health check failed: " + "; ".join(reasons), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
