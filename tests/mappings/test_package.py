"""Package hygiene: lazy imports, explicit API, one-way dependencies, no pickle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mappings

PACKAGE = Path(mappings.__file__).parent


def test_importing_mappings_does_not_import_torch():
    code = "import sys, mappings; from mappings import MappingError, MAPPING_VERSION; " \
           "print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.split()
    assert out == ["False", "False"]


def test_every_public_name_resolves():
    assert len(set(mappings.__all__)) == len(mappings.__all__)
    for name in mappings.__all__:
        assert getattr(mappings, name) is not None
    assert set(dir(mappings)) >= set(mappings.__all__)


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_mappings_never_imports_orchestra_agents_or_pickle():
    for path in PACKAGE.glob("*.py"):
        for module in _imported_modules(path):
            top = module.split(".")[0]
            assert top not in {"orchestra", "agents", "pickle", "dill", "cloudpickle"}, f"{path.name} imports {module}"
        text = path.read_text(encoding="utf-8")
        assert "torch.load(" not in text and "torch.save(" not in text, path.name
