"""Structured (JSON) output: find the first JSON object in a reply, validate it, repair if needed.

`run_with_repairs` owns the retry policy and is independent of how text is generated: it calls an
``attempt(index, repairs)`` function that returns a generation (anything with ``.text`` and
``.finish_reason``), so the runner plugs in real decoding and tests can plug in a scripted one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel

from agents.degenerate import Degeneracy, check_value, first_json_object
from agents.errors import OutputValidationError, TruncatedOutputError
from agents.grounding import Grounding, ground_value
from agents.prompt import RepairTurn
from agents.spec import AgentSpec, OutputSpec, ParsedOutput

__all__ = [
    "Generation",
    "JsonObjectTracker",
    "OutputProblem",
    "extract_json_object",
    "parse_output",
    "run_with_repairs",
    "salvage_truncated",
    "Structured",
]

_MAX_ECHO = 1500  # characters of a rejected reply echoed back in a repair turn


class Generation(Protocol):
    # Read-only, so a generation whose finish_reason is a narrower Literal still matches.
    @property
    def text(self) -> str: ...

    @property
    def finish_reason(self) -> str: ...


G = TypeVar("G", bound=Generation)


class JsonObjectTracker:
    """Feeds on streamed text; says when the first top-level JSON object has been closed."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.complete = False

    def feed(self, text: str) -> bool:
        for ch in text:
            if self.complete:
                break
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == "{":
                self.depth += 1
                self.started = True
            elif not self.started:
                continue
            elif ch == '"':
                self.in_string = True
            elif ch == "}":
                self.depth -= 1
                if self.depth == 0:
                    self.complete = True
        return self.complete

    @property
    def unfinished(self) -> bool:
        """An object was opened and never closed."""
        return self.started and not self.complete


def extract_json_object(text: str) -> dict[str, object] | None:
    """The first JSON object that parses, scanning each '{' in order (code fences and chatter allowed)."""
    return first_json_object(text)


def salvage_truncated(text: str) -> dict[str, object] | None:
    """The complete part of a JSON object cut off at max_new_tokens: drop the unfinished item, close the rest.

    Only values inside arrays are dropped (a list of facts cut mid-fact keeps the facts before it);
    None when nothing complete can be recovered.
    """
    start = text.find("{")
    if start < 0:
        return None
    stack: list[str] = []
    in_string = escaped = False
    best: dict[str, object] | None = None
    for pos in range(start, len(text)):
        ch = text[pos]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if stack and stack[-1] == "[":
                    best = _closed(text[start:pos + 1], stack) or best
            continue
        if ch == '"':
            in_string = True
        elif ch in "[{":
            stack.append(ch)
        elif ch in "]}":
            if not stack:
                return best
            stack.pop()
            if not stack:
                return best  # a complete object: not truncated
            if stack[-1] == "[":
                best = _closed(text[start:pos + 1], stack) or best
    return best


def _closed(head: str, stack: list[str]) -> dict[str, object] | None:
    closing = "".join("]" if c == "[" else "}" for c in reversed(stack))
    try:
        value = json.loads(head + closing)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class OutputProblem:
    """Why a reply was rejected and what to tell the model."""

    error: str
    truncated: bool
    instruction: str


def parse_output(text: str, output: OutputSpec,
                 finish_reason: str) -> tuple[ParsedOutput | None, OutputProblem | None]:
    """(validated value, None) on success, else (None, problem)."""
    fmt = output.format_instructions()
    value = extract_json_object(text)
    if value is None and finish_reason == "length":
        salvaged = salvage_truncated(text)
        if salvaged is not None:
            try:
                return output.validate_value(salvaged), None
            except ValueError:
                pass  # what was complete is not valid on its own: report the truncation below
    if value is None:
        tracker = JsonObjectTracker()
        tracker.feed(text)
        if finish_reason == "length" and tracker.unfinished:
            return None, OutputProblem(
                error="the reply stopped at max_new_tokens inside an unfinished JSON object",
                truncated=True,
                instruction="Your previous reply was cut off before the JSON object was complete. "
                            f"Reply again with a shorter, complete JSON object. {fmt}",
            )
        return None, OutputProblem(
            error="no JSON object found in the reply",
            truncated=False,
            instruction=f"Your previous reply did not contain a valid JSON object. {fmt}",
        )
    try:
        return output.validate_value(value), None
    except ValueError as exc:  # pydantic.ValidationError is a ValueError
        error = _short_error(exc)
        return None, OutputProblem(
            error=f"the JSON object does not match the required format: {error}",
            truncated=False,
            instruction=f"Your previous reply's JSON object did not match the required format ({error}). "
                        f"Reply again with a corrected JSON object. {fmt}",
        )


def _short_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for err in errors()[:5]:
            loc = ".".join(str(p) for p in err.get("loc", ())) or "object"
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        return "; ".join(parts)
    return str(exc)


@dataclass(frozen=True)
class Structured(Generic[G]):
    """The accepted generation, its validated value, and how many attempts it took."""

    generation: G
    value: ParsedOutput
    attempts: int
    degenerate: Degeneracy | None = None
    """Set when the last attempt was valid JSON but degenerate (see agents.degenerate); the run reports it."""
    grounding: Grounding | None = None
    """For grounded outputs: the accepted attempt's grounded / ungrounded items (ungrounded ones dropped)."""
    duplicates_removed: int = 0
    """List items of the accepted reply dropped as repeats of an earlier item (a grammar allows repeats)."""


def drop_repeated_items(value: object) -> tuple[object, int]:
    """The JSON value with every list's repeated string items removed (first kept; compared without case,
    spacing and trailing punctuation), and how many were removed."""
    removed = 0

    def walk(node: object) -> object:
        nonlocal removed
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            seen: set[str] = set()
            out = []
            for item in node:
                if isinstance(item, str):
                    key = " ".join(item.lower().split()).rstrip(" .;,")
                    if key in seen:
                        removed += 1
                        continue
                    seen.add(key)
                out.append(walk(item))
            return out
        return node

    return walk(value), removed


def _without_repeats(spec: AgentSpec, value: ParsedOutput) -> tuple[ParsedOutput, int]:
    """`value` with repeated list items dropped, when what is left still matches the schema."""
    raw = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    kept, removed = drop_repeated_items(raw)
    if not removed:
        return value, 0
    try:
        return spec.output.validate_value(kept), removed
    except ValueError:  # e.g. a minimum number of items: the repeats stay, the degenerate check decides
        return value, 0


def _review(spec: AgentSpec, value: ParsedOutput, document: str | None
            ) -> tuple[ParsedOutput, Grounding | None, Degeneracy | None, OutputProblem | None]:
    """Semantic checks after validation: degenerate content, then grounding (which may drop items)."""
    fmt = spec.output.format_instructions()
    degenerate = check_value(value, spec=spec)
    if degenerate is not None:
        return value, None, degenerate, OutputProblem(
            error=f"degenerate reply ({degenerate})", truncated=False,
            instruction=f"Your previous reply was not a real answer ({degenerate.detail}). Do the task for the "
                        f"document above with its own content. {fmt}")
    if not spec.output.grounded or document is None:
        return value, None, None, None
    raw = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    kept, grounding = ground_value(raw, document)
    if grounding.grounded == 0:
        return value, grounding, None, OutputProblem(
            error=f"none of the {grounding.checked} items is a verbatim span of the document", truncated=False,
            instruction=f"None of the items in your previous reply appears in the document word for word. Copy "
                        f"whole sentences from the document exactly as they are written. {fmt}")
    try:
        return spec.output.validate_value(kept), grounding, None, None
    except ValueError as exc:  # dropping ungrounded items broke the schema (e.g. a minimum length)
        return value, grounding, None, OutputProblem(
            error=f"after dropping ungrounded items the object is invalid: {_short_error(exc)}", truncated=False,
            instruction=f"Some items in your previous reply do not appear in the document word for word. Copy "
                        f"whole sentences from the document exactly as they are written. {fmt}")


def run_with_repairs(
    spec: AgentSpec,
    attempt: Callable[[int, Sequence[RepairTurn]], G],
    *,
    document: str | None = None,
) -> Structured[G]:
    """Generate, parse, validate and review; on failure retry with repair turns, up to spec.output.max_repairs times.

    Review: repeated string items of a list are dropped first (what is left must still match the schema);
    a degenerate value (`agents.degenerate.check_value`) is repaired; if the last attempt is
    still degenerate it is returned with ``degenerate`` set rather than raised, so the run can report
    it as such. With ``spec.output.grounded`` and a ``document``, ungrounded list items are dropped
    (`agents.grounding`); a reply with none grounded is repaired like an invalid one.
    Raises TruncatedOutputError if the last attempt stopped at max_new_tokens inside an unfinished JSON
    object, OutputValidationError if it was otherwise invalid.
    """
    repairs: list[RepairTurn] = []
    total = spec.output.max_repairs + 1
    for index in range(total):
        generation = attempt(index, tuple(repairs))
        value, problem = parse_output(generation.text, spec.output, generation.finish_reason)
        grounding = degenerate = None
        if problem is None:
            assert value is not None  # parse_output gives a value whenever it finds no problem
            value, removed = _without_repeats(spec, value)  # a repeated item is dropped, not fatal to the reply
            value, grounding, degenerate, problem = _review(spec, value, document)
            if problem is None:
                return Structured(generation=generation, value=value, attempts=index + 1, grounding=grounding,
                                  duplicates_removed=removed)
            if degenerate is not None and index + 1 == total:
                return Structured(generation=generation, value=value, attempts=total, degenerate=degenerate)
        if index + 1 == total:
            if problem.truncated:
                raise TruncatedOutputError(agent=spec.name, raw_output=generation.text,
                                           max_new_tokens=spec.generation.max_new_tokens, attempts=total)
            raise OutputValidationError(agent=spec.name, raw_output=generation.text, error=problem.error,
                                        attempts=total)
        echo = generation.text if len(generation.text) <= _MAX_ECHO else generation.text[:_MAX_ECHO]
        repairs.append(RepairTurn(previous_output=echo.strip(), instruction=problem.instruction))
    raise AssertionError("unreachable")
