"""Runtime inputs of a pipeline: values given per run (a question, a focus) that task templates read.

A pipeline declares its inputs (``inputs: {question: {description: ..., default: ...}}``, or just
``inputs: [question]``); a task template reads one as it reads an upstream agent's output
(``{question}``). Each run gives their values (``Pipeline.run(document, inputs=...)``,
``orchestra run --input question=...``); the document and everything cached over it stay the same,
so a pipeline asked a new question computes only its agents' own suffixes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from orchestra.errors import RunInputError

__all__ = ["InputSpec", "parse_input_args", "resolve_inputs"]


class InputSpec(BaseModel):
    """One declared input of a pipeline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = ""
    """What the value is for (shown by ``orchestra run`` when it is missing)."""
    default: str | None = None
    """The value a run that gives none uses; None: every run must give one."""


def parse_input_args(items: Sequence[str]) -> dict[str, str]:
    """``["question=What is covered?", ...]`` (the CLI's ``--input``) -> a mapping; RunInputError when malformed."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise RunInputError(f"--input {item!r} is not NAME=VALUE: write e.g. --input question='What is covered?'")
        name = name.strip()
        if name in out:
            raise RunInputError(f"--input {name} is given twice: give each input once")
        out[name] = value
    return out


def resolve_inputs(declared: Mapping[str, InputSpec], given: Mapping[str, object] | None) -> dict[str, str]:
    """Every declared input's value for one run: given, else its default; RunInputError naming what to fix."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(declared))
    if unknown:
        known = ", ".join(declared) or "(none: the pipeline declares no inputs)"
        raise RunInputError(f"input {unknown[0]!r} is not declared by the pipeline; its inputs: {known}")
    values: dict[str, str] = {}
    missing: list[str] = []
    for name, spec in declared.items():
        value = given.get(name, spec.default)
        if value is None:
            missing.append(name)
        elif not isinstance(value, str):
            raise RunInputError(f"input {name!r} must be text, not {type(value).__name__}")
        else:
            values[name] = value
    if missing:
        hints = "; ".join(f"{n}: {declared[n].description}" for n in missing if declared[n].description)
        raise RunInputError(f"missing input{'s' if len(missing) > 1 else ''} {', '.join(missing)}: give "
                            + " ".join(f"--input {n}=..." for n in missing) + " (or inputs={...} in Python)"
                            + (f" ({hints})" if hints else ""))
    return values

