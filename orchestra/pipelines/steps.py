"""Python steps and routing conditions: the non-LLM nodes of a pipeline, and when a node runs at all.

A step is a function (sync or async) that runs in the DAG beside the agents: it receives what it asks for
by parameter name (``document``, ``inputs``, ``upstream`` — every upstream output as a dict — or any
upstream's or input's own name) and returns a value that downstream agents read like an agent's output
(text as it is; anything else as JSON). An exception fails that step only; its dependants are skipped.

A condition (`when`) decides whether a node runs once its upstreams are done: a Python callable over the
upstream outputs, or in a pipeline file ``{agent: triage, equals: legal}`` (also ``not_equals``,
``contains``, ``in``). A node whose condition is false is ``skipped`` with the condition as its reason, and
so are the nodes that depend only on it.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from agents.references import import_reference
from orchestra.errors import PipelineValidationError

__all__ = ["StepNode", "Condition", "WhenLike", "call_step", "step_output", "condition_holds"]

_CALL = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Condition(BaseModel):
    """When a node runs, decided on one upstream's output (compared without surrounding space and case)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    agent: str = Field(description="The upstream agent or step whose output is tested (the node waits for it).")
    equals: str | None = Field(None, description="Runs when the output is this text.")
    not_equals: str | None = Field(None, description="Runs when the output is not this text.")
    contains: str | None = Field(None, description="Runs when the output contains this text.")
    not_contains: str | None = Field(None, description="Runs when the output does not contain this text.")
    in_: list[str] | None = Field(None, alias="in", description="Runs when the output is one of these texts.")

    @model_validator(mode="after")
    def _one_test(self) -> Condition:
        given = [k for k in ("equals", "not_equals", "contains", "not_contains", "in_") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a condition tests one thing: give exactly one of equals, not_equals, contains, "
                             "not_contains, in")
        return self

    def holds(self, outputs: Mapping[str, str]) -> bool:
        value = _norm(outputs.get(self.agent, ""))
        if self.equals is not None:
            return value == _norm(self.equals)
        if self.not_equals is not None:
            return value != _norm(self.not_equals)
        if self.contains is not None:
            return _norm(self.contains) in value
        if self.not_contains is not None:
            return _norm(self.not_contains) not in value
        return value in {_norm(v) for v in self.in_ or []}

    def describe(self) -> str:
        for key, word in (("equals", "is"), ("not_equals", "is not"), ("contains", "contains"),
                          ("not_contains", "does not contain")):
            if getattr(self, key) is not None:
                return f"{self.agent}'s output {word} {getattr(self, key)!r}"
        return f"{self.agent}'s output is one of {self.in_}"


WhenLike = Condition | Callable[[Mapping[str, str]], bool]
"""A node's `when`: a declarative `Condition`, or a callable given the upstream outputs (name -> text)."""


def condition_holds(when: WhenLike | None, outputs: Mapping[str, str]) -> tuple[bool, str]:
    """Whether a node with this condition runs, and the condition in words (for a skip reason)."""
    if when is None:
        return True, ""
    if isinstance(when, Condition):
        return when.holds(outputs), when.describe()
    name = getattr(when, "__name__", type(when).__name__)
    return bool(when(dict(outputs))), f"condition {name}()"


def _norm(text: str) -> str:
    return " ".join(str(text).split()).strip().strip(".").lower()


class StepNode(BaseModel):
    """A Python function in the pipeline's DAG (``steps:`` in a pipeline file, `Pipeline.step` in Python)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$", description="Unique node name; downstream reads it.")
    call: str = Field(description="The function as 'module:function' (imported when the pipeline is loaded).")
    upstream: list[str] = Field(default_factory=list, description="Agents or steps whose outputs it receives.")
    when: Condition | None = Field(None, description="Run only when this holds (else skipped, with the reason).")
    timeout_s: float | None = Field(None, gt=0, description="Give up on the step after this many seconds.")
    on_upstream_failure: Literal["skip", "run_with_available"] = Field(
        "skip", description="When an upstream gave nothing: skip the step (default), or run it on the upstreams that "
        "succeeded (at least one must); it is given only those.")

    _fn: Callable[..., Any] | None = PrivateAttr(None)
    _when_fn: Callable[[Mapping[str, str]], bool] | None = PrivateAttr(None)

    @field_validator("call")
    @classmethod
    def _importable(cls, value: str) -> str:
        if value != "<python>" and not _CALL.match(value):
            raise ValueError(f"{value!r} is not 'module:function' (e.g. 'mypackage.checks:count_clauses')")
        return value

    @model_validator(mode="after")
    def _resolved(self) -> StepNode:
        """A step named by 'module:function' is imported now, so a wrong path is found when the pipeline loads."""
        if self.call != "<python>":
            self.function()
        return self

    @classmethod
    def of(cls, fn: Callable[..., Any], *, name: str | None = None, upstream: list[str] | None = None,
           when: WhenLike | None = None, timeout_s: float | None = None,
           on_upstream_failure: Literal["skip", "run_with_available"] = "skip") -> StepNode:
        """A step of a Python callable (the builder's `Pipeline.step`)."""
        node = cls(name=name or getattr(fn, "__name__", "step"), call="<python>", upstream=list(upstream or []),
                   when=when if isinstance(when, Condition) else None, timeout_s=timeout_s,
                   on_upstream_failure=on_upstream_failure)
        node._fn = fn
        node._when_fn = None if when is None or isinstance(when, Condition) else when
        node.check_signature()
        return node

    def function(self) -> Callable[..., Any]:
        """The step's function (imported from `call` on first use)."""
        if self._fn is None:
            try:
                fn = import_reference(self.call, what="step")
            except (ImportError, AttributeError, ValueError) as exc:
                raise ValueError(f"cannot import {self.call!r} ({type(exc).__name__}: {exc}); check the module path "
                                 "(a pipeline file's own folder is searched first)") from exc
            if not callable(fn):
                raise ValueError(f"{self.call!r} is not callable")
            self._fn = fn
            self.check_signature()
        return self._fn

    @property
    def condition(self) -> WhenLike | None:
        return self._when_fn if self._when_fn is not None else self.when

    def check_signature(self) -> None:
        """Every parameter without a default is one the step can be given; else a PipelineValidationError."""
        fn = self._fn
        if fn is None:
            return
        known = {"document", "inputs", "upstream"} | (set(self.upstream) if self.on_upstream_failure == "skip" else set())
        for param in inspect.signature(fn).parameters.values():
            if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL) or param.default is not param.empty:
                continue
            if param.name not in known:
                raise PipelineValidationError(
                    f"step {self.name!r}: parameter {param.name!r} of {getattr(fn, '__name__', fn)!r} is not one it "
                    f"can be given: name it document, inputs, upstream or one of its upstreams "
                    f"({', '.join(self.upstream) or 'none'}), or give it a default")


async def call_step(node: StepNode, document: str, upstream: Mapping[str, str], inputs: Mapping[str, str]) -> str:
    """Run the step's function with the arguments it asks for (a sync one in a worker thread); its output as text."""
    from agents.bridge import in_thread

    fn = node.function()
    params = inspect.signature(fn).parameters
    offered: dict[str, object] = {"document": document, "inputs": dict(inputs), "upstream": dict(upstream),
                                  **inputs, **upstream}
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_all and k not in ("document", "inputs", "upstream")
              or k in params}
    if inspect.iscoroutinefunction(fn):
        result = await fn(**kwargs)
    else:
        result = await in_thread(functools.partial(fn, **kwargs))
        if inspect.isawaitable(result):
            result = await result
    return step_output(result)


def step_output(value: object) -> str:
    """What downstream nodes read of a step's return value: text as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return json.dumps(value, default=str, ensure_ascii=False)
