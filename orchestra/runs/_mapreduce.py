"""Chunked runs' pure parts: the calls' units of work, and how per-chunk outputs combine into one output.

A per-chunk (map) agent's outputs are joined in chunk order, each headed by its chunk's label
("[chunk 2/5, page 3]"), so what it says can be traced to a page or section; a JSON agent's parsed
values merge into one valid JSON value (lists concatenated, exact duplicates dropped, list items that
are objects given the chunk they came from). A reduce agent reads its upstreams' outputs as its
document (`notes_document`), each under a ``### name`` heading (a JSON agent's parsed items as lines,
`readable`), and its task's references to them
read as pointers into that document (`pointer`), so a long set of notes never overflows its suffix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.runner import AgentResult
    from orchestra.documents.chunking import Chunk

__all__ = ["Part", "Combined", "combine", "merge_json", "notes_document", "pointer", "readable", "round_label"]


@dataclass(frozen=True)
class Part:
    """One call's prefix: a document chunk (round 0) or a chunk of a reduce round's notes."""

    chunk: Chunk
    label: str
    ids: list[int]
    member: str
    """The model alias whose tokenizer laid out `ids`."""
    round: int = 0


@dataclass(frozen=True)
class Combined:
    """A chunked agent's one output, from its calls' outputs."""

    text: str
    downstream: str
    parsed: object = None
    degenerate: str | None = None
    duplicates_removed: int = 0
    calls: int = 1


def pointer(upstream: str) -> str:
    """What a reduce agent's task reads for an upstream: where its output is in the (notes) document."""
    return f"(under ### {upstream} in the notes above)"


def notes_document(outputs: Mapping[str, str]) -> str:
    """A reduce agent's document: each upstream's output under its name."""
    return "\n\n".join(f"### {name}\n{text.strip()}" for name, text in outputs.items()) + "\n"


def readable(value: object) -> str:
    """A JSON agent's parsed value as notes a reduce agent reads: list items as ``- item`` lines (an object item's
    fields on its line, its chunk in brackets), an object's keys as labels; no JSON syntax to copy or cut."""
    if isinstance(value, dict):
        blocks = []
        for key, item in value.items():
            if isinstance(item, list):
                blocks.append(f"{key}:\n{readable(item)}" if item else f"{key}: (none)")
            else:
                blocks.append(f"{key}: {_inline(item)}")
        return "\n".join(blocks)
    if isinstance(value, list):
        return "\n".join(f"- {_inline(item)}" for item in value)
    return _inline(value)


def _inline(value: object) -> str:
    if isinstance(value, dict):
        chunk = value.get("chunk")
        fields = "; ".join(f"{k}: {_inline(v)}" for k, v in value.items() if k != "chunk")
        return f"{fields} {chunk}" if isinstance(chunk, str) else fields
    if isinstance(value, list):
        return ", ".join(_inline(v) for v in value)
    return str(value).strip() if value is not None else "(none)"


def round_label(chunk: Chunk, total: int, round_: int) -> str:
    return f"[notes {chunk.index + 1}/{total}, round {round_}]"


def combine(json_output: bool, results: Sequence[tuple[Part, AgentResult]]) -> Combined:
    """The calls' outputs as one: joined under their labels (a single call's output as it is)."""
    kept = [(part, result) for part, result in results if result.degenerate is None]
    if not kept:
        reasons = "; ".join(f"{part.label}: {result.degenerate}" for part, result in results)
        text = "\n\n".join(f"{part.label}\n{result.text.strip()}" for part, result in results)
        return Combined(text=text, downstream="", degenerate=reasons, calls=len(results))
    if len(results) == 1:
        result = kept[0][1]
        return Combined(text=result.output_text(), downstream=result.downstream_text(), parsed=_plain(result.parsed))
    if json_output:  # each chunk shows what no earlier chunk did: overlapping chunks yield the same items
        shown: set[str] = set()
        text = "\n\n".join(f"{part.label}\n{json.dumps(_unseen(_plain(result.parsed), shown), ensure_ascii=False, indent=2)}"
                           for part, result in kept)
    else:
        text = "\n\n".join(f"{part.label}\n{result.output_text().strip()}" for part, result in kept)
    if not json_output:
        downstream = "\n\n".join(f"{part.label}\n{result.downstream_text().strip()}" for part, result in kept)
        return Combined(text=text, downstream=downstream, calls=len(results))
    parsed, dropped = merge_json([(part.label, _plain(result.parsed)) for part, result in kept])
    return Combined(text=text, downstream=json.dumps(parsed, ensure_ascii=False), parsed=parsed,
                    duplicates_removed=dropped, calls=len(results))


def merge_json(values: Sequence[tuple[str, object]]) -> tuple[object, int]:
    """One JSON value from each chunk's (label, value), and how many exact duplicates were dropped.

    Lists concatenate (objects in them gain ``"chunk": label`` unless they have one; an item the same as an earlier
    one, `_sameness`, is dropped); objects merge key by key (list values concatenate, the first non-empty other
    value wins); anything else becomes a list.
    """
    if all(isinstance(v, list) for _, v in values):
        return _concat([(label, v) for label, v in values if isinstance(v, list)])
    if all(isinstance(v, dict) for _, v in values):
        merged: dict[str, object] = {}
        dropped = 0
        keys = list(dict.fromkeys(k for _, v in values if isinstance(v, dict) for k in v))
        for key in keys:
            column = [(label, v[key]) for label, v in values if isinstance(v, dict) and key in v]
            if all(isinstance(item, list) for _, item in column):
                merged[key], n = _concat([(label, item) for label, item in column if isinstance(item, list)])
                dropped += n
            else:
                merged[key] = next((item for _, item in column if item not in (None, "", [], {})), column[0][1])
        return merged, dropped
    return _concat([(label, [v]) for label, v in values])


def _concat(lists: Sequence[tuple[str, list[object]]]) -> tuple[list[object], int]:
    out: list[object] = []
    seen: set[str] = set()
    dropped = 0
    for label, items in lists:
        for item in items:
            key = _sameness(item)  # the chunk label is no part of sameness
            if key in seen:
                dropped += 1
                continue
            seen.add(key)
            out.append({**item, "chunk": label} if isinstance(item, dict) and "chunk" not in item else item)
    return out, dropped


def _unseen(value: object, shown: set[str]) -> object:
    """`value` with every list item already in `shown` left out (`_sameness`), and its items added to `shown`."""
    if isinstance(value, dict):
        return {key: _unseen(item, shown) if isinstance(item, list) else item for key, item in value.items()}
    if not isinstance(value, list):
        return value
    kept = []
    for item in value:
        key = _sameness(item)
        if key not in shown:
            shown.add(key)
            kept.append(item)
    return kept


def _sameness(item: object) -> str:
    """What makes two list items the same: strings without case, spacing and trailing punctuation (as a reply's
    own repeats are compared, `agents.structured.drop_repeated_items`), anything else its canonical JSON."""
    if isinstance(item, str):
        return " ".join(item.lower().split()).rstrip(" .;,")
    return json.dumps(item, sort_keys=True, ensure_ascii=False)


def _plain(value: object) -> object:
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) else value
