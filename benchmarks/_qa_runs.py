"""What the QA benchmarks share: the passages' windows, and answers kept in a JSON as they come."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestra.bench import QAQuestion, QASet


def passage_windows(qa: QASet, questions: Iterable[QAQuestion], window: int,
                    tokenizer: Any) -> Iterator[tuple[str, list[QAQuestion], str, list[int]]]:
    """Each passage's questions with the `window` document tokens around it: (passage id, questions, the window's
    text, its document prefix ids as every agent's prompt lays it out)."""
    from agents import DocumentPrompt
    from orchestra.bench import passage_window, token_offsets

    offsets: dict[str, list[tuple[int, int]]] = {}
    for pid, qs in qa.by_passage(list(questions)).items():
        passage = qa.passage(pid)
        doc = qa.document_text(passage.document)
        if passage.document not in offsets:
            offsets[passage.document] = token_offsets(doc, tokenizer)
        text, _ = passage_window(doc, passage.start, passage.end, window, tokenizer, offsets[passage.document])
        yield pid, qs, text, DocumentPrompt(text).token_ids(tokenizer)


def chosen(parser: argparse.ArgumentParser, value: str, known: Iterable[str], what: str) -> list[str]:
    """The comma-separated names in `value`; a parser error naming the known ones for any other."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    known = list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


class ResumableResults:
    """results/<name>.json: what a benchmark measured, saved as it goes (an interrupted run resumes), with every
    command that added to it; and its Markdown beside it."""

    def __init__(self, out: Path, name: str, argv: list[str], *, record: bool) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path = out / f"{name}.json", out / f"{name}.md"
        self.data: dict[str, Any] = json.loads(self.json_path.read_text()) if self.json_path.exists() else {}
        if "command" in self.data:  # written before the file kept every command
            self.data.setdefault("commands", [self.data.pop("command")])
        self.commands: list[str] = self.data.setdefault("commands", [])
        if record:
            self.commands.append(" ".join([f"python benchmarks/{name}.py", *argv]))

    def save(self) -> None:
        from mappings.atomic import write_atomic

        write_atomic(self.json_path, json.dumps(self.data, indent=0))

    def write_markdown(self, text: str) -> None:
        from mappings.atomic import write_atomic

        write_atomic(self.md_path, text)
