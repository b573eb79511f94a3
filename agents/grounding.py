"""Grounded extraction: items of a JSON reply must be verbatim spans of the document.

With ``OutputSpec(grounded=True)`` (the ``key_facts`` built-in's default) every string item of the
reply's lists must appear in the document word for word, compared after normalising case, whitespace
and punctuation (a fact copied with a different comma or line break still counts). The policy is
**drop**: ungrounded items are removed from the accepted value and listed in the `Grounding` result
(and the run report), so downstream agents only ever see text the document contains. A reply with no
grounded item at all is a validation failure and goes through the repair loop with an instruction
to copy sentences verbatim. Bare string fields outside lists are counted but never dropped.

Under grammar-constrained decoding the check is made at the source as well: `grounded_schema` turns
every list of strings in the schema into a list of the document's own sentences (a JSON-schema
``enum``), so a small model *chooses* sentences instead of writing them, and cannot invent one. The
check after decoding stays, for unconstrained decoding and for schemas the grammar cannot express.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from agents.prompt import Tokenizer

__all__ = ["Grounding", "normalize", "is_grounded", "ground_value", "document_sentences", "grounded_schema"]


class Grounding(BaseModel):
    """How many extracted items are verbatim spans of the document, and which are not."""

    model_config = ConfigDict(frozen=True)

    checked: int
    """String items checked."""
    grounded: int
    """Items found verbatim (case/whitespace/punctuation-normalised) in the document."""
    ungrounded: list[str]
    """The items not found; dropped from list fields of the accepted value."""
    repeated: int = 0
    """List items dropped because an earlier item of the same list says the same (normalised) thing."""


def normalize(text: str) -> str:
    """Casefolded, punctuation replaced by spaces, whitespace collapsed: the form spans are compared in."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.casefold()).split())


def is_grounded(item: str, normalized_document: str) -> bool:
    """Whether ``item`` (non-blank) occurs in the document (given already normalised)."""
    norm = normalize(item)
    return bool(norm) and f" {norm} " in f" {normalized_document} "  # whole words only


def ground_value(value: Mapping[str, object], document: str) -> tuple[dict[str, object], Grounding]:
    """``value`` with ungrounded string items removed from its lists, and the grounding counts."""
    doc = normalize(document)
    checked = grounded = 0
    ungrounded: list[str] = []
    repeated = 0

    def visit(node: object) -> object:
        nonlocal checked, grounded, repeated
        if isinstance(node, dict):
            return {k: visit(v) for k, v in node.items()}
        if isinstance(node, list):
            kept: list[object] = []
            seen: set[str] = set()
            for item in node:
                if isinstance(item, str):
                    if normalize(item) in seen:  # a small model picks one sentence again: say it once
                        repeated += 1
                        continue
                    seen.add(normalize(item))
                    checked += 1
                    if is_grounded(item, doc):
                        grounded += 1
                        kept.append(item)
                    else:
                        ungrounded.append(item)
                else:
                    kept.append(visit(item))
            return kept
        if isinstance(node, str):
            checked += 1
            if is_grounded(node, doc):
                grounded += 1
            else:
                ungrounded.append(node)
        return node

    kept = {k: visit(v) for k, v in value.items()}  # visit(value), as a dict
    return kept, Grounding(checked=checked, grounded=grounded, ungrounded=ungrounded, repeated=repeated)


_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+|\n\s*\n")
MAX_SENTENCES = 512
"""Sentences offered to the grammar at most (the first ones): bounds grammar size and compile time."""


def document_sentences(document: str, *, min_chars: int = 24, max_chars: int = 300) -> list[str]:
    """The document's sentences (and paragraph-sized lines), whitespace collapsed, in order, without repeats.

    Pieces shorter than ``min_chars`` (headings, numbering) or longer than ``max_chars`` are left out:
    the former are not facts, the latter would not fit a fact's length limit.
    """
    seen: set[str] = set()
    out: list[str] = []
    for piece in _SENTENCE_END.split(document):
        text = " ".join(piece.split())
        if min_chars <= len(text) <= max_chars and text not in seen:
            seen.add(text)
            out.append(text)
            if len(out) == MAX_SENTENCES:
                break
    return out


def grounded_schema(schema: Mapping[str, object], document: str | None = None, *, max_items: int | None = None,
                    min_chars: int = 24) -> dict[str, object] | None:
    """``schema`` for the grammar: each array-of-strings property limited to the document's sentences
    (when ``document`` is given) and every array to ``max_items``; None when nothing changes.

    Only top-level ``properties`` are rewritten (the shape of every built-in JSON agent); string
    length limits are dropped there since every choice is a whole sentence of bounded length.
    """
    sentences = document_sentences(document, min_chars=min_chars) if document is not None else []
    props = schema.get("properties")
    if not isinstance(props, dict):
        return None
    rewritten = dict(props)
    changed = False
    for name, prop in props.items():
        if not isinstance(prop, dict) or prop.get("type") != "array":
            continue
        new = dict(prop)
        items = prop.get("items")
        if sentences and isinstance(items, dict) and items.get("type") == "string":
            new["items"] = {"type": "string", "enum": sentences}
        if max_items is not None:
            new["maxItems"] = min(int(prop.get("maxItems", max_items)), max_items)
        if new != prop:
            rewritten[name] = new
            changed = True
    return {**schema, "properties": rewritten} if changed else None


def grounded_reply_tokens(tokenizer: Tokenizer, schema: Mapping[str, object], document: str, max_items: int) -> int:
    """Tokens the longest reply a grounded grammar allows can take: each list property holding its
    ``max_items`` longest sentences, laid out as the agents' fixed layout writes it (2-space indent).

    A JSON agent's reply budget is at least this, so a grounded reply always finishes its JSON: one
    that stops at ``max_new_tokens`` mid-item loses the item it was writing and every item after it.
    """
    import json

    props = schema.get("properties")
    sentences = document_sentences(document)
    if not isinstance(props, dict) or not sentences:
        return 0
    lengths = sorted((len(tokenizer.encode(json.dumps(s, ensure_ascii=False), add_special_tokens=False))
                      for s in sentences), reverse=True)
    longest = sum(lengths[:max_items])
    lists = [name for name, prop in props.items() if isinstance(prop, dict) and prop.get("type") == "array"]
    skeleton = json.dumps({name: ["" for _ in range(min(max_items, len(lengths)))] for name in lists}, indent=2)
    return longest * len(lists) + len(tokenizer.encode(skeleton, add_special_tokens=False))
