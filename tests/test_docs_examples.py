"""Every ```python block of README.md and docs/quickstart.md runs as written, on a tiny family home.

Each block runs in its own Python process with ``ORCHESTRA_HOME`` pointing at a family home laid out by
`build_family` (members root, finetuned, quantized, distilled, int8), whose members derive from a tiny
llama model, and with the working directory a scratch copy of ``examples/`` whose documents are cut to
their first characters (the tiny models' context is small): a block reads
``examples/long_document_analysis/document.txt`` as it would from a clone's root. A block that is not
meant to run starts with the line ``# not run: <why>``; keep that rare (a fragment is better a ```text
or ```bash block).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/quickstart.md")
DOCUMENT_CHARS = 1500  # about as many tokens under the tiny tokenizer, with room for each agent's reply
CONTEXT = 4096  # the tiny models are made with 512 positions; RoPE takes more, and the agents need them
BLOCK_TIMEOUT_S = HANG_GUARD_S  # a hang guard, not a budget: load never fails a block

_PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_NOT_RUN = re.compile(r"#\s*not run:\s*(\S.*)")


def python_blocks(doc: str) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block of `doc`."""
    text = (REPO / doc).read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _PYTHON_BLOCK.finditer(text)]


BLOCKS = [pytest.param(doc, line, code, id=f"{doc}:{line}") for doc in DOCS for line, code in python_blocks(doc)]


@pytest.fixture(scope="module")
def docs_home(tmp_path_factory) -> Path:
    """A family home like the bundled one, its members derived from a tiny llama model with a 4,096-token
    context (built in this module's own folder: the session's shared tiny models keep their 512)."""
    from tests.tiny_family import build_tiny_home

    home = build_tiny_home(tmp_path_factory.mktemp("docs_examples"), CONTEXT)
    return home


@pytest.fixture(scope="module")
def docs_workdir(tmp_path_factory) -> Path:
    """A working directory holding a copy of ``examples/``, each text document cut to DOCUMENT_CHARS."""
    work = tmp_path_factory.mktemp("docs_workdir")
    shutil.copytree(REPO / "examples", work / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    for document in (work / "examples").rglob("*.txt"):
        document.write_text(document.read_text(encoding="utf-8")[:DOCUMENT_CHARS], encoding="utf-8")
    return work


def test_the_readme_and_the_quickstart_have_python_examples():
    for doc in DOCS:
        assert python_blocks(doc), f"{doc} has no ```python block: this test would check nothing there"


@pytest.mark.parametrize(("doc", "line", "code"), BLOCKS)
def test_python_block_runs(doc, line, code, docs_home, docs_workdir):
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    if (skip := _NOT_RUN.match(first)) is not None:
        pytest.skip(f"{doc}:{line} is marked not run: {skip.group(1)}")
    env = {**os.environ, "ORCHESTRA_HOME": str(docs_home), "ORCHESTRA_KV_STORE": "off",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run([sys.executable, "-c", code], cwd=docs_workdir, env=env, capture_output=True,
                                text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"the ```python block at {doc} line {line} ran past {BLOCK_TIMEOUT_S}s:\n{code}\n"
                    f"--- its stderr, last 4000 characters ---\n{err[-4000:]}", pytrace=False)
    if result.returncode != 0:
        pytest.fail(f"the ```python block at {doc} line {line} exited {result.returncode} "
                    f"(run with ORCHESTRA_HOME={docs_home}, in {docs_workdir}):\n{code}\n"
                    f"--- its stderr, last 4000 characters ---\n{result.stderr[-4000:]}", pytrace=False)
