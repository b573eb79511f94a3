"""The README's main job, in seconds: the demo pipeline on a tiny family, with only what the install gave.

CI runs this in a fresh venv holding exactly what the README's first command installs, so a core
install that misses something the demo needs fails CI instead of a user's first run. It checks the
demo's own preflight (the grammar library for its JSON agent, the family builder's libraries), builds
a family home whose four members derive from a tiny llama model (the bundled builder's real write
path, not the 25-minute GGUF build), and runs ``orchestra run`` on the demo's pipeline file over the
start of the demo's document, then the long demo's chunked pipeline (``demo --long``: BM25 chunk choice,
map and reduce agents) over the start of its document. Exit 0 only when both commands exit 0, which they
do only when every agent succeeded.

    python scripts/smoke_demo.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "long_document_analysis"
DOCUMENT_CHARS = 1500  # about as many tokens under the tiny tokenizer: the document, then each agent's reply
LONG_CHARS = 6000  # `orchestra demo --long`'s pipeline over the start of its document: a few 2,048-token chunks
CONTEXT = 4096  # the tiny models are made with 512 positions; RoPE takes more, and the report agent needs them


def build_tiny_home(scratch: Path) -> Path:
    """A family home laid out by `build_family`, its members derived from a freshly trained tiny llama."""
    sys.path.insert(0, str(ROOT))
    from tests.tiny_family import build_tiny_home as build

    return build(scratch, CONTEXT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build in this folder and keep it (default: a temporary one)")
    args = parser.parse_args(argv)

    from agents.constrained import require_grammar
    from orchestra.family.build import require_build_dependencies

    require_grammar()
    require_build_dependencies()

    scratch = args.keep or Path(tempfile.mkdtemp(prefix="orchestra-smoke-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        home = build_tiny_home(scratch)
        document = scratch / "document.txt"
        text = (EXAMPLE / "document.txt").read_text(encoding="utf-8")
        document.write_text(text[:DOCUMENT_CHARS], encoding="utf-8")
        exe = shutil.which("orchestra", path=os.path.dirname(sys.executable)) or "orchestra"
        cmd = [exe, "run", str(EXAMPLE / "pipeline.yaml"), "--home", str(home), "--document", str(document),
               "--report", str(scratch / "report.json")]
        print("+", " ".join(cmd), flush=True)
        code = subprocess.call(cmd, env={**os.environ, "ORCHESTRA_HOME": str(home)})
        print(f"smoke: orchestra run exited {code}", flush=True)
        if code:
            return code
        long_doc = scratch / "licences.md"
        long_doc.write_text((EXAMPLE / "licences.md").read_text(encoding="utf-8")[:LONG_CHARS], encoding="utf-8")
        cmd = [exe, "run", str(EXAMPLE / "long.yaml"), "--home", str(home), "--document", str(long_doc),
               "--report", str(scratch / "long-report.json")]
        print("+", " ".join(cmd), flush=True)
        code = subprocess.call(cmd, env={**os.environ, "ORCHESTRA_HOME": str(home)})
        print(f"smoke: the long demo's pipeline exited {code}", flush=True)
        return code
    finally:
        if args.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
