"""The scripts under benchmarks/ are programs, not a package: tests load them by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (its ``main`` not run)."""
    if str(ROOT / "benchmarks") not in sys.path:  # where a script run as a program finds its shared `_x` modules
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: dataclasses resolve a module's string annotations through sys.modules.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
