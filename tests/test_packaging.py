"""The three import packages: import cheaply and depend on each other one way only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
