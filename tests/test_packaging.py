"""The three import packages: import cheaply and depend on each other one way only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {"mappings": {"orchestra", "agents"}, "agents": {"orchestra"}}


def test_import_all_three_without_loading_torch():
    code = "import sys, orchestra, agents, mappings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


def test_imports_flow_one_way():
    offenders = []
    for package, banned in FORBIDDEN.items():
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                offenders += [f"{path.relative_to(REPO)} imports {n}" for n in names if n.split(".")[0] in banned]
    assert offenders == []


def test_public_api_is_declared():
    import agents
    import mappings
    import orchestra

    for module in (orchestra, agents, mappings):
        assert isinstance(module.__all__, list)
        for name in module.__all__:
            assert getattr(module, name) is not None


def _requirements() -> tuple[set[str], dict[str, set[str]]]:
    """The core requirements and each extra's, as canonical distribution names (from pyproject.toml)."""
    import re

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}

    return names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}


def _third_party_imports() -> dict[str, set[str]]:
    """Every top-level module the three packages import (inside functions too), with the files importing it."""
    found: dict[str, set[str]] = {}
    local = {"orchestra", "agents", "mappings"}
    for package in local:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top not in local and top not in sys.stdlib_module_names:
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_imported_library_is_declared_by_the_distribution():
    from importlib.metadata import packages_distributions

    core, extras = _requirements()
    declared = core.union(*extras.values())
    dists = packages_distributions()
    undeclared = {}
    for module, files in _third_party_imports().items():
        owners = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not owners & declared:
            undeclared[module] = sorted(files)
    assert undeclared == {}, f"imported but not in pyproject.toml's dependencies or extras: {undeclared}"


def test_core_install_holds_what_the_demo_pipeline_runs_and_nothing_only_some_users_need():
    core, extras = _requirements()
    assert {"torch", "transformers", "xgrammar", "psutil", "huggingface-hub", "safetensors"} <= core
    assert not {"peft", "gguf", "matplotlib", "accelerate", "fastapi", "ray"} & core
    assert extras["build"] == {"peft", "gguf"} and extras["bench"] == {"matplotlib"}
    assert "ray" in extras["ray"] and {"fastapi", "uvicorn"} <= extras["serve"]


def test_distribution_name_is_not_the_unrelated_pypi_orchestra_and_ships_type_information():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert data["project"]["name"] == "orchestra-kv"
    package_data = data["tool"]["setuptools"]["package-data"]
    for package in ("orchestra", "agents", "mappings"):
        assert (REPO / package / "py.typed").is_file()
        assert "py.typed" in package_data[package]


def test_readme_first_command_installs_the_family_builder_and_runs_the_demo():
    lines = (REPO / "README.md").read_text().split("```")[1].splitlines()[1:3]
    demo, tests = lines
    assert demo.endswith("&& orchestra demo") and '".[build]"' in demo
    assert tests.endswith("python -m pytest -n 2 --dist loadfile") and '".[dev]"' in tests
