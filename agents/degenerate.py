"""Detecting degenerate replies: empty, mostly whitespace, looping, or a copy of the prompt's own example.

Small models fail in a few recognisable ways: an empty reply, a fragment followed by dozens of blank
lines, one line (or phrase) repeated until max_new_tokens, or the format example / instruction text
copied back verbatim. Such a reply must never reach a downstream agent as if it were an answer: JSON
agents send it through the repair loop (`agents.structured`), text agents end with status
``degenerate`` in the run report. The checks are cheap string statistics with thresholds in a typed
policy; each verdict says which rule fired and why.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from agents.spec import AgentSpec

__all__ = ["DegenerateReason", "Degeneracy", "DegeneracyPolicy", "check_text", "check_value", "prompt_examples"]

DegenerateReason = Literal["empty", "whitespace", "repeated_line", "repetition_loop", "format_example", "prompt_echo"]


@dataclass(frozen=True)
class Degeneracy:
    """Why a reply was judged degenerate."""

    reason: DegenerateReason
    """Which rule fired."""
    detail: str
    """A human-readable explanation with the numbers that made it fire."""

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


@dataclass(frozen=True)
class DegeneracyPolicy:
    """Thresholds of the degenerate-output checks."""

    max_whitespace_fraction: float = 0.6
    """Whitespace characters over all characters above this (replies of 20+ characters): mostly whitespace."""
    max_blank_lines: int = 8
    """More consecutive blank lines than this: whitespace padding, not an answer."""
    min_lines_for_repeat: int = 4
    """Only replies with at least this many non-blank lines are checked for a repeated line."""
    max_line_share: float = 0.5
    """The most common non-blank line making up more than this share of the lines: a loop."""
    loop_ngram_words: int = 4
    """Word n-gram size of the phrase-loop check."""
    min_words_for_loop: int = 30
    """Only replies with at least this many words are checked for a phrase loop."""
    min_distinct_ngram_fraction: float = 0.3
    """Distinct word n-grams over all n-grams below this: the reply repeats itself."""
    min_echo_chars: int = 24
    """A reply (or JSON string) at least this long that is a verbatim piece of the agent's own instructions is an echo."""


DEFAULT_POLICY = DegeneracyPolicy()


_LIST_MARKER = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)]|[a-z][.)])\s+", re.IGNORECASE)  # "1. x" and "2. x" repeat x


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.casefold()).split())


def prompt_examples(spec: AgentSpec) -> tuple[str, ...]:
    """String values of any JSON example in the agent's format instructions (what small models copy)."""
    found: list[str] = []
    value = first_json_object(spec.output.instructions or "")
    if value is not None:
        found.extend(s for s in _strings(value) if s.strip())
    schema = spec.output.schema_dict() or {}
    found.extend(s for s in _strings(_schema_examples(schema)) if s.strip())
    return tuple(dict.fromkeys(found))


def first_json_object(text: str) -> dict[str, object] | None:
    """The first JSON object that parses, scanning each '{' in order (code fences and chatter allowed).

    Lives here because agents.structured imports this module, not the reverse; structured re-exports it.
    """
    decoder = json.JSONDecoder()
    pos = text.find("{")
    while pos >= 0:
        try:
            value, _ = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            pass
        else:
            if isinstance(value, dict):
                return value
        pos = text.find("{", pos + 1)
    return None


def _schema_examples(node: object) -> list[object]:
    out: list[object] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("examples", "example"):
                out.append(value)
            else:
                out.extend(_schema_examples(value))
    elif isinstance(node, list):
        for value in node:
            out.extend(_schema_examples(value))
    return out


def _strings(value: object) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif hasattr(value, "model_dump"):
        yield from _strings(value.model_dump(mode="json"))


def _instruction_text(spec: AgentSpec) -> str:
    """The agent's own words: role, the literal parts of its task, its format instructions (no upstream text)."""
    literal = "".join(text for kind, text in spec._segments if kind == "text")
    return _norm(f"{spec.role}\n{literal}\n{spec.output.format_instructions()}")


def _echo(piece: str, spec: AgentSpec | None, policy: DegeneracyPolicy) -> Degeneracy | None:
    if spec is None:
        return None
    norm = _norm(piece)
    if len(norm) >= policy.min_echo_chars and norm in _instruction_text(spec):
        return Degeneracy("prompt_echo", f"the reply {piece.strip()[:80]!r} is copied from the agent's own instructions")
    return None


def check_text(text: str, *, spec: AgentSpec | None = None, examples: Sequence[str] = (),
               policy: DegeneracyPolicy = DEFAULT_POLICY) -> Degeneracy | None:
    """None if ``text`` looks like a real reply, else why it is degenerate.

    ``spec`` enables the prompt-echo check against the agent's own instructions; ``examples`` are
    strings that must not be the reply (default: `prompt_examples(spec)`).
    """
    stripped = text.strip()
    if not stripped:
        return Degeneracy("empty", "the reply is empty" if not text else f"the reply is only whitespace ({len(text)} characters)")
    blank_lines = _longest_blank_run(text)
    if blank_lines > policy.max_blank_lines:
        return Degeneracy("whitespace", f"{blank_lines} consecutive blank lines (more than {policy.max_blank_lines})")
    spaces = sum(ch.isspace() for ch in text)
    if len(text) >= 20 and spaces / len(text) > policy.max_whitespace_fraction:
        return Degeneracy("whitespace", f"{spaces} of {len(text)} characters are whitespace "
                                        f"(more than {policy.max_whitespace_fraction:.0%})")
    lines = [_norm(_LIST_MARKER.sub("", line)) for line in stripped.splitlines() if line.strip()]
    lines = [line for line in lines if line]
    if len(lines) >= policy.min_lines_for_repeat:
        line, count = Counter(lines).most_common(1)[0]
        if count > 1 and count / len(lines) > policy.max_line_share:
            return Degeneracy("repeated_line", f"one line makes up {count} of {len(lines)} lines: {line[:60]!r}")
    words = _norm(stripped).split()
    n = policy.loop_ngram_words
    if len(words) >= policy.min_words_for_loop:
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        distinct = len(set(grams)) / len(grams)
        if distinct < policy.min_distinct_ngram_fraction:
            return Degeneracy("repetition_loop", f"only {distinct:.0%} of its {n}-word phrases are distinct "
                                                 f"(under {policy.min_distinct_ngram_fraction:.0%})")
    found = _example_copy([stripped], examples if examples or spec is None else prompt_examples(spec))
    if found is not None:
        return found
    return _echo(stripped, spec, policy)


def _example_copy(pieces: Sequence[str], examples: Sequence[str]) -> Degeneracy | None:
    normalized = {_norm(e): e for e in examples if _norm(e)}
    for piece in pieces:
        if _norm(piece) in normalized:
            return Degeneracy("format_example", f"{piece.strip()[:80]!r} is the format example from the instructions")
    return None


def check_value(value: object, *, spec: AgentSpec | None = None, examples: Sequence[str] = (),
                policy: DegeneracyPolicy = DEFAULT_POLICY) -> Degeneracy | None:
    """None if a parsed JSON value looks like a real reply, else why it is degenerate.

    Degenerate: no non-blank string anywhere, a string copied from the format example, every item
    of a list of 2+ strings the same, or a string that is a verbatim piece of the agent's instructions.
    """
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    strings = list(_strings(value))
    if strings and not any(s.strip() for s in strings):
        return Degeneracy("empty", "every string in the JSON object is blank")
    if not strings and not _has_content(value):
        return Degeneracy("empty", "the JSON object has no content")
    found = _example_copy(strings, examples if examples or spec is None else prompt_examples(spec))
    if found is not None:
        return found
    for items in _lists(value):
        texts = [_norm(s) for s in items if isinstance(s, str)]
        if len(texts) >= 2 and len(set(texts)) == 1:
            first = next(s for s in items if isinstance(s, str))
            return Degeneracy("repeated_line", f"all {len(texts)} list items are the same: {first[:60]!r}")
    for piece in strings:
        echo = _echo(piece, spec, policy)
        if echo is not None:
            return echo
    for piece in strings:  # one long string field can still loop or pad
        if len(piece) > 200:
            inner = check_text(piece, policy=policy)
            if inner is not None and inner.reason in ("whitespace", "repeated_line", "repetition_loop"):
                return inner
    return None


def _longest_blank_run(text: str) -> int:
    """The most consecutive blank (empty or whitespace-only) lines between two non-blank ones or at the end."""
    longest = run = 0
    for line in text.strip("\n").split("\n")[1:] if text.lstrip() else []:
        run = run + 1 if not line.strip() else 0
        longest = max(longest, run)
    trailing = text.rstrip(" \t").count("\n") - text.rstrip().count("\n")  # blank lines after the last text
    return max(longest, trailing - 1)


def _has_content(value: object) -> bool:
    if isinstance(value, dict):
        return any(_has_content(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_content(v) for v in value)
    return value is not None


def _lists(value: object) -> Iterable[list[object]]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _lists(v)
    elif isinstance(value, list):
        yield value
        for v in value:
            yield from _lists(v)
