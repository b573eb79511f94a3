"""scripts/code_health.py: its counting rules on small synthetic trees, and its thresholds on this repo."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from tests.waiting import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "code_health.py"


@pytest.fixture(scope="module")
def health() -> ModuleType:
    spec = importlib.util.spec_from_file_location("code_health", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["code_health"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, files: dict[str, str]) -> Path:
    for package in ("orchestra", "agents", "mappings"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return root


def _function(name: str, lines: int, decorator: str = "") -> str:
    """A function spanning exactly ``lines`` lines from its ``def`` line."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2))
    return f"{decorator}def {name}() -> int:\n{body}    return 0\n"


def test_a_function_of_61_lines_is_long_and_one_of_60_is_not(health, tmp_path):
    root = _tree(tmp_path, {"mappings/m.py": _function("sixty", 60) + "\n\n" + _function("sixty_one", 61)})
    report = health.scan(root)
    assert [(f.name, f.lines) for f in report.long_functions] == [("sixty_one", 61)]
    assert report.long_functions[0].path == "mappings/m.py"


def test_nested_functions_and_methods_are_measured_too(health, tmp_path):
    inner = textwrap.indent(_function("inner", 85), "    ")
    method = textwrap.indent(_function("method", 90), "    ")
    source = "def outer() -> None:\n" + inner + "\n\nclass C:\n" + method
    report = health.scan(_tree(tmp_path, {"agents/a.py": source}))
    assert {f.name for f in report.long_functions} == {"outer", "inner", "method"}


def test_typer_commands_are_listed_apart_from_long_functions(health, tmp_path):
    source = "import typer\napp = typer.Typer()\n\n" + _function("cmd", 120, "@app.command('go')\n")
    report = health.scan(_tree(tmp_path, {"orchestra/cli.py": source}))
    assert report.long_functions == []
    assert [f.name for f in report.typer_commands] == ["cmd"]


def test_a_private_import_across_packages_is_found_and_one_within_a_package_is_not(health, tmp_path):
    root = _tree(tmp_path, {
        "orchestra/x.py": """
            from mappings.apply import _linear
            from orchestra.serve._app import create_app
            from orchestra._private import thing
        """,
        "agents/y.py": """
            def lazy() -> None:
                import mappings._impl
                from mappings._cache import build
                from mappings import __version__, public
        """,
    })
    report = health.scan(root)
    found = sorted((i.path, i.statement) for i in report.private_imports)
    assert found == [
        ("agents/y.py", "from mappings._cache import build"),
        ("agents/y.py", "import mappings._impl"),
        ("orchestra/x.py", "from mappings.apply import _linear"),
    ]


def test_benchmarks_must_import_orchestra_bench_names_from_its_public_api(health, tmp_path):
    root = _tree(tmp_path, {
        "orchestra/bench/__init__.py": '__all__ = ["machine_info"]\n',
        "benchmarks/b.py": """
            from orchestra.bench import machine_info
            from orchestra.bench import hidden
            from orchestra.bench.pipeline import pipeline_markdown
            from orchestra.bench._run import run
            from mappings.apply import _linear
            from mappings.apply import map_cache
        """,
    })
    report = health.scan(root)
    flagged = sorted(i.statement for i in report.benchmark_imports)
    assert flagged == [
        "from mappings.apply import _linear",
        "from orchestra.bench import hidden",
        "from orchestra.bench._run import run",
        "from orchestra.bench.pipeline import pipeline_markdown",
    ]
    assert report.private_imports == []  # benchmarks are reported on their own


def test_any_is_counted_in_annotations_but_not_in_strings_or_calls(health, tmp_path):
    source = """
        from __future__ import annotations
        import typing
        from typing import Any, TypeAlias, cast

        Json = dict[str, Any]                        # 1: a module-level alias
        Alias: TypeAlias = "list[Any]"               # 0: a string
        Other: TypeAlias = typing.Any | None         # 1 (the TypeAlias annotation itself is not Any)

        def f(a: Any, *args: list[Any], b: typing.Any = None, **kw: Any) -> dict[str, Any]:  # 5
            x: Any = cast(Any, a)                    # 1: the annotation, not the cast
            note = "Any"                             # 0
            y: "Any" = 1                             # 0: a string annotation
            return {}

        class C:
            field: tuple[Any, ...]                   # 1
    """
    report = health.scan(_tree(tmp_path, {"mappings/t.py": source}))
    assert report.any_total == 9
    assert report.any_by_file == {"mappings/t.py": 9}


def test_check_fails_with_one_line_reason_and_passes_otherwise(health, tmp_path, capsys):
    long_ones = "\n\n".join(_function(f"f{i}", 81) for i in range(6))
    root = _tree(tmp_path, {"mappings/m.py": long_ones + "\n\nfrom typing import Any\nx: Any = 1\n"})
    assert health.main(["--root", str(root), "--check", "--max-any", "-1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "6 functions over 60 lines (max 0)" in err[0] and "Any" not in err[0]
    assert health.main(["--root", str(root)]) == 0  # without --check it only reports
    capsys.readouterr()
    assert health.main(["--root", str(root), "--check", "--max-any", "0"]) == 1
    assert "1 Any annotations (max 0)" in capsys.readouterr().err


def test_json_output_lists_what_the_table_counts(health, tmp_path, capsys):
    root = _tree(tmp_path, {"orchestra/x.py": "from agents.runner import _helper\n" + _function("g", 100)})
    assert health.main(["--root", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [f["name"] for f in data["long_functions"]] == ["g"]
    assert data["private_imports"][0]["statement"] == "from agents.runner import _helper"


def test_the_repo_meets_the_function_length_private_import_and_crossing_thresholds():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check", "--max-any", "-1"], cwd=REPO,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, f"{done.stderr}\n{done.stdout}"


def test_sync_async_crossings_are_counted_per_kind_and_file_however_they_are_imported(health, tmp_path, capsys):
    root = _tree(tmp_path, {
        "orchestra/a.py": """
            import anyio
            import anyio.to_thread
            import asyncio
            import threading

            async def f(loop) -> None:
                await anyio.to_thread.run_sync(print)          # anyio.to_thread.run_sync
                anyio.from_thread.run(f, loop)                 # anyio.from_thread.run
                anyio.from_thread.run_sync(print)              # anyio.from_thread.run_sync
                await loop.run_in_executor(None, print)        # .run_in_executor
                threading.Thread(target=print).start()         # threading.Thread

            anyio.run(f, None)                                 # anyio.run
            asyncio.run(f(None))                               # asyncio.run
            asyncio.run_coroutine_threadsafe(f(None), None)    # asyncio.run_coroutine_threadsafe
            anyio.to_thread.current_default_thread_limiter()   # not a crossing
            print("anyio.run(x)")                              # a string: not a call
        """,
        "agents/b.py": """
            from anyio.to_thread import run_sync
            from anyio import from_thread as ft
            import anyio.to_thread as tt
            from threading import Thread
            from agents.bridge import ThreadStream

            async def g() -> None:
                await run_sync(print)                          # anyio.to_thread.run_sync
                await tt.run_sync(print)                       # anyio.to_thread.run_sync
                ft.run_sync(print)                             # anyio.from_thread.run_sync
                Thread(target=print)                           # threading.Thread
                async with ThreadStream(print) as s:           # ThreadStream
                    pass
                ThreadStream[int, int](print)                  # ThreadStream
        """,
        "mappings/c.py": """
            from trio import run
            from mypool import Thread

            run(print)                                         # trio's run: not a crossing
            Thread()                                           # not threading's
            pipeline.run_sync("doc")                           # a pipeline's own run_sync: not a crossing
        """,
    })
    report = health.scan(root)
    assert report.crossings_by_kind() == {
        "anyio.to_thread.run_sync": 3,
        "anyio.from_thread.run": 1,
        "anyio.from_thread.run_sync": 2,
        "anyio.run": 1,
        "asyncio.run": 1,
        "asyncio.run_coroutine_threadsafe": 1,
        "threading.Thread": 2,
        ".run_in_executor": 1,
        "ThreadStream": 2,
    }
    assert report.top_crossing_files() == [("orchestra/a.py", 8), ("agents/b.py", 6)]
    assert [c.line for c in report.crossings if c.path == "agents/b.py"] == [9, 10, 11, 12, 13, 15]

    assert health.main(["--root", str(root), "--json", "--check"]) == 1  # 14: over the bridge's budget of 9
    assert "14 sync/async crossings (max 9)" in capsys.readouterr().err
    assert health.main(["--root", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["crossings"]["total"] == 14
    assert data["crossings"]["by_kind"]["anyio.to_thread.run_sync"] == 3
    assert data["crossings"]["top_files"][0] == {"path": "orchestra/a.py", "count": 8}
    assert health.main(["--root", str(root)]) == 0
    table = capsys.readouterr().out
    assert "sync/async crossings (max 9)                      14" in table
    assert "     3  anyio.to_thread.run_sync" in table and "     6  agents/b.py" in table
