"""Structured (JSON) output: find the first JSON object in a reply, validate it, repair if needed.

`run_with_repairs` owns the retry policy and is independent of how text is generated: it calls an
``attempt(index, repairs)`` function that returns a generation (anything with ``.text`` and
``.finish_reason``), so the runner plugs in real decoding and tests can plug in a scripted one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from agents.errors import OutputValidationError, TruncatedOutputError
from agents.prompt import RepairTurn
from agents.spec import AgentSpec, OutputSpec

__all__ = [
    "Generation",
    "JsonObjectTracker",
    "OutputProblem",
    "extract_json_object",
    "parse_output",
    "run_with_repairs",
    "Structured",
]

_MAX_ECHO = 1500  # characters of a rejected reply echoed back in a repair turn


class Generation(Protocol):
    text: str
    finish_reason: str


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


def extract_json_object(text: str) -> dict[str, Any] | None:
    """The first JSON object that parses, scanning each '{' in order (code fences and chatter allowed)."""
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


@dataclass(frozen=True)
class OutputProblem:
    """Why a reply was rejected and what to tell the model."""

    error: str
    truncated: bool
    instruction: str


def parse_output(text: str, output: OutputSpec, finish_reason: str) -> tuple[Any, OutputProblem | None]:
    """(validated value, None) on success, else (None, problem)."""
    fmt = output.format_instructions()
    value = extract_json_object(text)
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
    value: Any
    attempts: int


def run_with_repairs(
    spec: AgentSpec,
    attempt: Callable[[int, Sequence[RepairTurn]], G],
) -> Structured[G]:
    """Generate, parse and validate; on failure retry with repair turns, up to spec.output.max_repairs times.

    Raises TruncatedOutputError if the last attempt stopped at max_new_tokens inside an unfinished JSON
    object, OutputValidationError if it was otherwise invalid.
    """
    repairs: list[RepairTurn] = []
    total = spec.output.max_repairs + 1
    for index in range(total):
        generation = attempt(index, tuple(repairs))
        value, problem = parse_output(generation.text, spec.output, generation.finish_reason)
        if problem is None:
            return Structured(generation=generation, value=value, attempts=index + 1)
        if index + 1 == total:
            if problem.truncated:
                raise TruncatedOutputError(agent=spec.name, raw_output=generation.text,
                                           max_new_tokens=spec.generation.max_new_tokens, attempts=total)
            raise OutputValidationError(agent=spec.name, raw_output=generation.text, error=problem.error,
                                        attempts=total)
        echo = generation.text if len(generation.text) <= _MAX_ECHO else generation.text[:_MAX_ECHO]
        repairs.append(RepairTurn(previous_output=echo.strip(), instruction=problem.instruction))
    raise AssertionError("unreachable")
