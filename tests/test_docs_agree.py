"""The docs name only what exists: every `orchestra ...` command line they show names real commands and flags,
and every dotted Python name (`orchestra.x.y`, `agents.x`, `mappings.x`) they mention imports."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"`(orchestra(?: [^`]*)?)`")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
DOTTED = re.compile(r"`((?:orchestra|agents|mappings)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
# names in the docs that are not Python: logger names (docs/pipelines.md, "Logs") and span names (tracing)
NOT_PYTHON = {"orchestra.cache", "orchestra.cache.prefill", "orchestra.kvstore", "orchestra.run", "orchestra.agent",
              "orchestra.gate", "orchestra.tool", "orchestra.serve.access", "orchestra.serve.runs"}


def _tree():
    import typer.main

    from orchestra.cli import app

    return typer.main.get_command(app)


def _mentions(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return [(doc.relative_to(REPO).as_posix(), m.group(1)) for doc in DOCS for m in pattern.finditer(doc.read_text())]


def test_every_command_line_in_the_docs_names_real_commands_and_flags() -> None:
    root = _tree()
    wrong = []
    for doc, line in _mentions(COMMAND):
        command, words = root, line.split()[1:]
        for word in words:  # the subcommand path: `orchestra family calibrate ...`
            sub = getattr(command, "commands", {}).get(word)
            if sub is None:
                break
            command = sub
        else:
            word = ""
        if word and not word.startswith("-") and getattr(command, "commands", None) and word.isalpha() \
                and word.islower() and word not in ("PIPELINE", "FILE"):
            wrong.append(f"{doc}: `{line}`: {word!r} is not a subcommand of `{command.name or 'orchestra'}`")
            continue
        known = {"--help"} | {o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
        if command is root:
            known |= {"--version", "-V", "--debug"}
        wrong += [f"{doc}: `{line}`: {flag} is no option of `{command.name or 'orchestra'}`"
                  for flag in FLAG.findall(line) if flag not in known]
    assert not wrong, "\n".join(wrong)


def _exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ImportError:
            try:
                found = importlib.util.find_spec(module) is not None
            except ImportError:
                found = False
            if found and i == len(parts):  # a module whose optional dependency is not installed here (vLLM)
                return True
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", [d.relative_to(REPO).as_posix() for d in DOCS])
def test_every_python_name_a_page_mentions_exists(doc: str) -> None:
    missing = sorted({name for page, name in _mentions(DOTTED) if page == doc
                      and name not in NOT_PYTHON and not _exists(name)})
    assert not missing, f"{doc} names what does not exist: {', '.join(missing)}"
