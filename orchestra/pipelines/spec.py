"""Pipeline definitions: a typed model loadable from YAML/JSON or built in Python (see `orchestra.Pipeline`).

Everything is validated when the `PipelineSpec` is built, before any model loads, and as deeply as a
run would: every agent's `AgentSpec` is built (built-in looked up in `agents.builtin.BUILTINS`, its
arguments checked, templates parsed, generation bounds checked), upstreams resolved and the DAG
checked. So `orchestra graph FILE` refuses exactly what `orchestra run FILE` refuses. Mistakes are
typed `PipelineError`s whose message names the file (when there is one), the agent and the field;
validation problems are `PipelineValidationError` (`PipelineFileError` for files), with the list of
problems in ``.problems``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import re
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

from agents.builtin import BUILTINS
from agents.spec import AGENT_NAME_PATTERN, AgentSpec
from mappings.repair import RepairPolicy
from orchestra.errors import (
    AdapterBaseError,
    CycleError,
    PipelineError,
    PipelineFileError,
    PipelineProblem,
    PipelineValidationError,
    QuantizeBaseError,
    QuantizeError,
    UnknownAgentError,
)
from orchestra.familycache import ExecutorSpec, MemberResources
from orchestra.familycache.gates import GatePolicy
from orchestra.models.modelref import AdapterSpec, QuantizeSpec
from orchestra.pipelines.inputs import InputSpec
from orchestra.pipelines.steps import Condition, StepNode, WhenLike

__all__ = [
    "pipeline_mermaid","AgentNode", "MappingPolicy", "PipelineSettings", "PipelineSpec", "load_pipeline", "suggest",
    "ExecutorSpec", "MemberResources", "KVStoreSettings", "ChunkingPolicy"]

# Custom pydantic error types: they carry (agent, field, message) through pydantic's error list, so the
# final message can name the agent and the field instead of a list index.
_AGENT_ERROR = "agent_definition"
_PIPELINE_ERROR = "pipeline_definition"


def suggest(value: str, choices: Sequence[str]) -> str | None:
    """The choice closest to ``value`` (case, ``_`` and ``-`` ignored: ``KeyFacts`` -> ``key_facts``), or None."""
    def norm(text: str) -> str:
        return re.sub(r"[^a-z0-9]", "", text.lower())

    by_norm = {norm(c): c for c in choices}
    if norm(value) in by_norm:
        return by_norm[norm(value)]
    close = difflib.get_close_matches(norm(value), list(by_norm), n=1, cutoff=0.6)
    return by_norm[close[0]] if close else None


def _did_you_mean(value: str, choices: Sequence[str]) -> str:
    close = suggest(value, choices)
    return f" (did you mean {close!r}?)" if close else ""


def _agent_error(agent: str | None, problems: list[tuple[str, str]]) -> PydanticCustomError:
    """One pydantic error carrying an agent's problems as (field, message) pairs."""
    detail = "; ".join(f"{field}: {message}" for field, message in problems)
    return PydanticCustomError(_AGENT_ERROR, "{detail}", {"detail": detail, "agent": agent,
                                                          "problems": tuple(problems)})


def _pipeline_error(field: str, message: str, agent: str | None = None) -> PydanticCustomError:
    return PydanticCustomError(_PIPELINE_ERROR, "{detail}", {"detail": message, "field": field, "agent": agent})


_V = TypeVar("_V", bound="_Validated")


class _Validated(BaseModel):
    """Pipeline models raise `PipelineValidationError` (naming agent and field) instead of a raw ValidationError.

    Construction is wrapped (``Model(...)``, ``model_validate``, ``model_validate_json``). Pydantic calls a
    custom ``__init__`` for nested models too (an agent given as a mapping inside a pipeline): the nested
    PipelineValidationError is a ValueError, so pydantic records it as that field's error, and the outer
    conversion takes its problems over, prefixing their location.
    """

    def __init__(self, /, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise PipelineValidationError(problems=_problems(exc, type(self), data)) from exc

    @classmethod
    def model_validate(cls: type[_V], obj: object, **kwargs: Any) -> _V:  # kwargs: pydantic's own options
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise PipelineValidationError(problems=_problems(exc, cls, obj)) from exc

    @classmethod
    def model_validate_json(cls: type[_V], json_data: str | bytes | bytearray, **kwargs: Any) -> _V:
        try:
            data = json.loads(json_data)
        except ValueError as exc:
            raise PipelineValidationError(f"not valid JSON: {exc}") from exc
        return cls.model_validate(data, **kwargs)


class MappingPolicy(BaseModel):
    """Where mappings come from and what happens when one is missing."""

    model_config = ConfigDict(extra="forbid")
    directory: str | None = Field(None, description="Mapping store folder (default: <family home>/mappings).")
    on_missing: Literal["calibrate", "refuse"] = Field(
        "calibrate", description="Calibrate a missing (source, target) mapping on demand, with a warning, or refuse."
    )
    method: str | None = Field(None, description="Calibration method for on-demand mappings (default: the library's).")
    tokens: int = Field(8192, ge=512, description="Calibration tokens for on-demand mappings.")
    tail_tokens: int = Field(32, ge=0, description="Trailing document tokens recomputed on the target after mapping.")
    repair: RepairPolicy | None = Field(
        None, description="Map, then repair: spend this budget of target compute recomputing sink/tail tokens "
        "(and optionally layer blocks) of every mapped cache; e.g. {budget: 0.1}.",
    )
    repair_costs: Literal["measured", "compute"] = Field(
        "measured", description="How a repair budget is priced: 'measured' times each target's passes once on this "
        "machine (kept beside the mappings), so the budget is a share of its prefill seconds; 'compute' counts "
        "multiply-adds.",
    )


class KVStoreSettings(BaseModel):
    """The disk tier: document caches kept on disk, read back by later runs and processes instead of prefilling."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool | None = Field(None, description="Keep document caches on disk for later runs (false: memory only; "
                                 "unset: on, unless the environment says ORCHESTRA_KV_STORE=off).")
    directory: str | None = Field(None, description="Store folder (default: $ORCHESTRA_KV_STORE, else <family home>/kv).")
    budget_mb: int = Field(8192, ge=1, description="Bytes the store may hold on disk, MiB (least recently used go first).")


class ChunkingPolicy(BaseModel):
    """Documents longer than a window: cut into overlapping chunks, each prefilled once and shared (map-reduce)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: chunk only a document that does not fit; always: chunk every document; never: "
        "refuse a document that does not fit (DocumentError).")
    window_tokens: int | None = Field(
        None, ge=32, description="Tokens of each chunk's prefix (default: what the smallest member's context leaves "
        "after the largest agent suffix and its max_new_tokens).")
    overlap_tokens: int = Field(64, ge=0, description="Trailing tokens of a chunk repeated at the next one's start.")
    parallel_calls: int | None = Field(
        None, ge=1, le=64, description="Chunk calls of one agent in flight at once (default: its member's replicas "
        "under the ray executor, else 1, since calls in one process take turns on the model).")


class AgentNode(_Validated):
    """One agent in the pipeline: what it does (a built-in or a spec), on which model, reading which upstreams.

    Building a node builds its `AgentSpec` (so every mistake in it is found here, before any model
    loads) and completes `upstream` with the agents its task template reads, so they are never
    written twice. `agent_spec()` returns the built spec.
    """

    model_config = ConfigDict(extra="forbid")
    name: str = Field(
        pattern=AGENT_NAME_PATTERN,
        description="Unique agent name; upstream references and task templates use it. Optional when it can be "
        "derived: the built-in's own default name (e.g. 'summarizer', '<target>_critic') or the spec's name.",
    )
    model: str = Field(description="Alias of a model declared in the pipeline's `models`.")
    builtin: str | None = Field(
        None, description="Name of a built-in agent in `agents.builtin.BUILTINS` (summarizer, key_facts, "
        "question_answerer, critic, report_writer).",
    )
    args: dict[str, object] = Field(default_factory=dict, description="Keyword arguments of the built-in agent.")
    spec: AgentSpec | dict[str, object] | None = Field(
        None, description="The agent's spec: a typed `agents.AgentSpec`, or a mapping of its fields (role, task, "
        "template_syntax, generation, output), validated into one when the node is built. The node's `name` "
        "wins over the spec's.",
    )
    upstream: list[str] = Field(
        default_factory=list,
        description="Agents whose outputs this agent reads. Defaults to (and always includes) the agents its "
        "task template reads; list more to make this agent wait for them too.",
    )
    gate: GatePolicy | None = Field(None, description="Gate policy for this agent (default: the pipeline's).")
    repair: RepairPolicy | None = Field(
        None, description="Repair of the mapped document caches this agent reads (default: its spec's "
        "`mapped_repair`, else the pipeline's `mapping.repair`).")
    timeout_s: float | None = Field(None, gt=0, description="Give up on this agent after this many seconds.")
    on_upstream_failure: Literal["skip", "run_with_available"] = Field(
        "skip", description="When an upstream failed, was skipped or was degenerate: skip this agent (default), or "
        "run it on the upstreams that succeeded (at least one must), its prompt saying which it lacks.")
    when: Condition | None = Field(
        None, description="Run only when this holds, e.g. {agent: triage, equals: legal} (else skipped, with the "
        "condition as the reason; the tested agent is waited for).")
    per_chunk: bool | None = Field(
        None, description="Chunked runs: run once per document chunk (true), or once over the combined outputs of "
        "its upstream agents (false); unset: per chunk when it has no upstream agents.")
    chunks: Literal["all"] | Annotated[int, Field(ge=1)] = Field(
        "all", description="Chunked runs, per-chunk agents: every chunk, or the k chunks most relevant to `query` "
        "(BM25).")
    query: str | None = Field(
        None, description="With chunks: k, what the chunks are ranked against (a template over the run's inputs and "
        "upstream outputs, as the task is); unset: a question_answerer's question, else the agent's task (whose "
        "instructions, e.g. 'the document above', also count as words to match).")

    _agent_spec: AgentSpec | None = PrivateAttr(None)
    _when_fn: Callable[[Mapping[str, str]], bool] | None = PrivateAttr(None)

    @property
    def condition(self) -> WhenLike | None:
        """The node's condition: a callable given in Python, else the declarative `when`."""
        return self._when_fn if self._when_fn is not None else self.when

    def with_condition(self, when: WhenLike | None) -> AgentNode:
        """This node with a condition (a `Condition` or a callable over the upstream outputs); chains."""
        if isinstance(when, Condition) or when is None:
            self.when, self._when_fn = when, None
        else:
            self._when_fn = when
        if isinstance(when, Condition) and when.agent not in self.upstream:
            self.upstream.append(when.agent)
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: object) -> object:
        """Fill a missing name from the spec or the built-in, so Python users need not repeat it."""
        if not isinstance(data, Mapping) or data.get("name") is not None:
            return data
        data = dict(data)
        spec, builtin = data.get("spec"), data.get("builtin")
        if isinstance(spec, AgentSpec):
            data["name"] = spec.name
        elif isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
            data["name"] = spec["name"]
        elif isinstance(builtin, str) and builtin in BUILTINS and isinstance(data.get("args", {}), Mapping):
            try:
                data["name"] = BUILTINS[builtin](**data.get("args", {})).name
            except Exception:  # the arguments are wrong: name it after the built-in, `_build` reports why
                data["name"] = builtin
        elif isinstance(builtin, str) and re.match(AGENT_NAME_PATTERN, builtin):
            data["name"] = builtin  # an unknown built-in: `_build` says so, under this name
        return data

    @field_validator("spec", mode="plain")
    @classmethod
    def _spec_kind(cls, value: object) -> AgentSpec | dict[str, object] | None:
        if value is None or isinstance(value, AgentSpec):
            return value
        if isinstance(value, Mapping):
            return dict(value)
        raise PydanticCustomError(
            "spec_type", "must be an agents.AgentSpec or a mapping of its fields (role, task, generation, output), "
            "not {kind}", {"kind": type(value).__name__},
        )

    @model_validator(mode="after")
    def _build(self) -> AgentNode:
        if (self.builtin is None) == (self.spec is None):
            raise _agent_error(self.name, [("builtin", "give exactly one of `builtin` or `spec` (a built-in "
                                                       "agent's name, or an AgentSpec or its fields)")])
        if self.builtin is not None:
            spec = _call_builtin(self.name, self.builtin, self.args)
        elif self.args:
            raise _agent_error(self.name, [("args", "`args` are a built-in agent's arguments, and this agent has "
                                                    "a `spec`: put its settings in the spec")])
        elif isinstance(self.spec, AgentSpec):
            spec = self.spec
        else:
            spec = _spec_from_mapping(self.name, self.spec or {})
        if spec.name != self.name:
            spec = spec.model_copy(update={"name": self.name})
        self._agent_spec = spec
        tested = [self.when.agent] if self.when is not None else []
        self.upstream = list(dict.fromkeys([*spec.required_inputs(), *self.upstream, *tested]))
        return self

    def agent_spec(self) -> AgentSpec:
        """The agent's `agents.AgentSpec`, built (and checked) when the node was."""
        if self._agent_spec is None:  # only for nodes made with model_construct, which skips validation
            self._agent_spec = type(self).model_validate(self.model_dump())._agent_spec
        assert self._agent_spec is not None
        return self._agent_spec

    def template_inputs(self) -> tuple[str, ...]:
        """The upstream agents the task template reads (the rest of `upstream` was listed explicitly)."""
        return self.agent_spec().required_inputs()


def _call_builtin(agent: str, builtin: str, args: Mapping[str, object]) -> AgentSpec:
    factory = BUILTINS.get(builtin)
    if factory is None:
        raise _agent_error(agent, [("builtin", f"unknown built-in {builtin!r}{_did_you_mean(builtin, list(BUILTINS))}; "
                                               f"built-ins: {', '.join(BUILTINS)}")])
    import inspect

    params = [p for p in inspect.signature(factory).parameters]
    try:
        return factory(**args)
    except ValidationError as exc:
        if exc.title != factory.__name__:  # raised inside the factory: the spec it builds refuses a value
            raise _agent_error(agent, [("args", f"built-in {builtin!r} cannot build its spec: " + "; ".join(
                _strip(err["msg"]) for err in exc.errors()))]) from exc
        problems = []
        for err in exc.errors():
            param = str(err["loc"][0]) if err["loc"] else ""
            field = "args." + ".".join(str(p) for p in err["loc"]) if err["loc"] else "args"
            if err["type"] == "unexpected_keyword_argument":
                message = (f"unknown argument {param!r} of built-in {builtin!r}{_did_you_mean(param, params)}; "
                           f"it takes: {', '.join(params)}")
            elif err["type"] == "missing_argument":
                message = f"built-in {builtin!r} needs the argument {param!r}; add it"
            else:
                message = _strip(err["msg"])
                if "got " not in message:
                    message += f" (got {_shown(err.get('input'))})"
            problems.append((field, message))
        raise _agent_error(agent, problems) from exc
    except (TypeError, ValueError) as exc:
        raise _agent_error(agent, [("args", f"built-in {builtin!r} refused its arguments: {exc}")]) from exc


def _spec_from_mapping(agent: str, fields: Mapping[str, object]) -> AgentSpec:
    try:
        return AgentSpec.model_validate({**fields, "name": agent})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field, message = _describe(err, AgentSpec)
            message = message.removeprefix(f"agent {agent!r}: ")
            if not field and "task template" in message:
                field = "task"  # the template is parsed by a model validator, which has no field of its own
            problems.append(("spec" + (f".{field}" if field else ""), message))
        raise _agent_error(agent, problems) from exc


class PipelineSettings(_Validated):
    """Everything about a pipeline but its agents: models, source, devices, gates, mapping and store policy.

    `orchestra.Pipeline` validates its constructor arguments with it, so a bad setting is refused as
    soon as it is given, not when the first agent is added.
    """

    model_config = ConfigDict(extra="forbid")
    name: str = Field("pipeline", description="A name for reports and logs.")
    models: dict[str, str | AdapterSpec | QuantizeSpec] = Field(
        description="Alias -> family member name or role, a local model folder, a Hugging Face Hub id "
        "org/name[@revision], a LoRA adapter over another alias: {adapter: <folder or Hub id>, base: <alias>}, "
        "or a quantized view of another alias: {base: <alias>, quantize: int8}.")
    source: str | None = Field(None, description="Alias of the model that prefills the document (default: the most used).")
    devices: dict[str, str] = Field(default_factory=dict, description="Alias -> 'cpu', 'cuda:N' or 'auto'.")
    default_device: str = Field("auto", description="Device for models not listed in `devices`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Runtime dtype of every model; auto: bfloat16 on CUDA that supports it, float32 on CPU "
                            "(maps are always fitted in float32 and applied in the member's dtype).")
    gate: GatePolicy = Field(default_factory=GatePolicy, description="Default gate policy for agents on mapped caches.")
    mapping: MappingPolicy = Field(default_factory=MappingPolicy, description="Mapping store and on-demand calibration.")
    store_budget_mb: int = Field(4096, ge=1, description="Byte budget of the document KV store, MiB.")
    kv_store: KVStoreSettings = Field(default_factory=KVStoreSettings,
                                      description="The disk tier under the memory store (on by default).")
    max_concurrency_per_device: int = Field(1, ge=1, description="Agents running at once on one device.")
    executor: ExecutorSpec = Field(default_factory=ExecutorSpec,
                                   description="Where model work runs: local (default) or ray (docs/scale-out.md).")
    chunking: ChunkingPolicy = Field(default_factory=ChunkingPolicy,
                                     description="Documents longer than a window: chunked map-reduce (auto by default).")

    @field_validator("models", mode="before")
    @classmethod
    def _adapter_entries(cls, value: object) -> object:
        """A mapping value is a LoRA adapter (`AdapterSpec`) or a quantized view (`QuantizeSpec`); a path is its text."""
        if not isinstance(value, Mapping):
            return value
        out: dict[object, object] = {}
        for alias, target in value.items():
            if isinstance(target, Mapping) and "adapter" not in target:
                target = _quantize_spec(str(alias), target)
            elif isinstance(target, Mapping):
                target = _adapter_spec(str(alias), target)
            elif isinstance(target, os.PathLike):
                target = os.fspath(target)
            out[alias] = target
        return out

    @model_validator(mode="after")
    def _aliases_declared(self) -> PipelineSettings:
        _check_adapter_bases(self.models)
        _check_view_bases(self.models)
        if self.source is not None and self.source not in self.models:
            raise _pipeline_error("source", _unknown("source", self.source, self.models))
        for alias in self.devices:
            if alias not in self.models:
                raise _pipeline_error("devices", _unknown("devices names model", alias, self.models))
        for alias in self.executor.members:
            if alias not in self.models:
                raise _pipeline_error("executor", _unknown("executor.members names model", alias, self.models))
        return self


class PipelineSpec(PipelineSettings):
    """A whole pipeline: the family's models by alias, the agents, the source, gates and mapping policy.

    Building one checks every agent (its AgentSpec is built), that agents use declared models, that
    names are unique, that every upstream is an agent of the pipeline and that there is no cycle.
    """

    agents: list[AgentNode] = Field(min_length=1, description="The agents; order does not matter, upstreams do.")
    steps: list[StepNode] = Field(
        default_factory=list, description="Python functions in the DAG: {name, call: 'module:function', upstream, "
        "when}; their return values are read downstream like an agent's output.")
    inputs: dict[str, InputSpec] = Field(
        default_factory=dict, description="Runtime inputs that task templates read as {name}: name -> {description, "
        "default}, or a list of names; each run gives their values (Pipeline.run(inputs=...), --input NAME=VALUE).")

    @field_validator("inputs", mode="before")
    @classmethod
    def _input_names(cls, value: object) -> object:
        if isinstance(value, (list, tuple)):
            return {str(name): {} for name in value}
        return value

    @field_validator("inputs")
    @classmethod
    def _input_names_valid(cls, inputs: dict[str, InputSpec]) -> dict[str, InputSpec]:
        for name in inputs:
            if not re.match(AGENT_NAME_PATTERN, name):
                raise _pipeline_error(f"inputs.{name}", "an input's name is letters, digits, _ or - (it is read as "
                                      "{name} in task templates)")
        return inputs

    @field_validator("agents")
    @classmethod
    def _unique_names(cls, agents: list[AgentNode]) -> list[AgentNode]:
        seen: set[str] = set()
        for agent in agents:
            if agent.name in seen:
                raise _pipeline_error("name", f"two agents are named {agent.name!r}; agent names must be unique",
                                      agent=agent.name)
            seen.add(agent.name)
        return agents

    @field_validator("steps")
    @classmethod
    def _steps_wait_for_what_they_test(cls, steps: list[StepNode]) -> list[StepNode]:
        for step in steps:
            if step.when is not None and step.when.agent not in step.upstream:
                step.upstream.append(step.when.agent)
        return steps

    @model_validator(mode="after")
    def _agents_consistent(self) -> PipelineSpec:
        for agent in self.agents:
            if agent.model not in self.models:
                raise _pipeline_error("model", _unknown("uses model", agent.model, self.models), agent=agent.name)
            if agent.name in self.inputs:
                raise _pipeline_error(f"inputs.{agent.name}", "an input and an agent share this name: rename one "
                                      "(templates read both as {name})", agent=agent.name)
            explicit = [u for u in agent.upstream if u in self.inputs and u not in agent.template_inputs()]
            if explicit:
                raise _pipeline_error("upstream", f"lists input {explicit[0]!r}: an input is read by the task "
                                      "template, not waited for; remove it from upstream", agent=agent.name)
            # a template's reads of inputs are not agents to wait for
            agent.upstream = [u for u in agent.upstream if u not in self.inputs]
        names = {a.name for a in self.agents}
        for step in self.steps:
            if step.name in names or step.name in self.inputs:
                raise _pipeline_error(f"steps.{step.name}", "a step shares its name with an agent or an input: "
                                      "rename one (downstream nodes read all three by name)")
            names.add(step.name)
            if any(u in self.inputs for u in step.upstream):
                raise _pipeline_error(f"steps.{step.name}.upstream", "lists an input: a step is given the inputs "
                                      "(as `inputs`, or by name); remove it from upstream")
        check_upstreams([*self.agents, *self.steps], inputs=self.inputs)
        return self

    def node(self, name: str) -> AgentNode | StepNode:
        """The agent or step of that name."""
        for step in self.steps:
            if step.name == name:
                return step
        return self.agent(name)

    def input_reads(self, agent: str) -> tuple[str, ...]:
        """The pipeline inputs `agent`'s task template reads."""
        return tuple(n for n in self.agent(agent).template_inputs() if n in self.inputs)

    @property
    def source_alias(self) -> str:
        if self.source is not None:
            return self.source
        counts: dict[str, int] = {}
        for agent in self.agents:
            counts[agent.model] = counts.get(agent.model, 0) + 1
        # ties go to the first declared model, so the choice is stable
        order = list(self.models)
        return max(counts, key=lambda alias: (counts[alias], -order.index(alias)))

    def upstreams(self) -> dict[str, list[str]]:
        """Agent or step -> the agents and steps it reads or waits for (the template's reads included)."""
        out = {agent.name: list(agent.upstream) for agent in self.agents}
        out.update({step.name: list(step.upstream) for step in self.steps})
        return out

    def agent(self, name: str) -> AgentNode:
        for agent in self.agents:
            if agent.name == name:
                return agent
        raise UnknownAgentError(f"no agent named {name!r}{_did_you_mean(name, [a.name for a in self.agents])}; "
                                f"agents: {', '.join(a.name for a in self.agents)}")


def check_upstreams(agents: Sequence[AgentNode | StepNode], inputs: Collection[str] = ()) -> None:
    """Every upstream is an agent of the pipeline and there is no cycle; else UnknownAgentError / CycleError.

    These are raised as themselves (not collected as problems) because they are about the graph, not
    about one field: the message still names the agent and the field that holds the reference.
    """
    from orchestra.pipelines.graph import build_graph

    names = [a.name for a in agents]
    for agent in agents:
        for up in agent.upstream:
            if up == agent.name:
                raise CycleError(f"agent {agent.name!r}, field {_reference_field(agent, up)}: the agent reads its "
                                 f"own output; remove the reference")
            if up not in names:
                field = _reference_field(agent, up)
                declare = f", or declare {up!r} in the pipeline's `inputs`" if field == "spec.task" else ""
                raise UnknownAgentError(
                    f"agent {agent.name!r}, field {field}: reads {up!r}, which is not an agent "
                    f"of this pipeline{_did_you_mean(up, [*names, *inputs])}; agents: {', '.join(names)}"
                    + (f"; inputs: {', '.join(inputs)}" if inputs else "") + declare
                )
    build_graph({a.name: a.upstream for a in agents})  # cycles


def _reference_field(agent: AgentNode | StepNode, up: str) -> str:
    if isinstance(agent, StepNode) or up not in agent.template_inputs():
        return "upstream"
    return "args" if agent.builtin is not None else "spec.task"


def _adapter_spec(alias: str, fields: Mapping[object, object]) -> AdapterSpec:
    """`AdapterSpec` from a ``{adapter: ..., base: ...}`` mapping, each mistake one pipeline problem."""
    where = f"models.{alias}"
    extra = sorted(str(k) for k in fields if k not in ("adapter", "base"))
    if extra:
        raise _pipeline_error(where, f"unknown field {extra[0]!r} of a LoRA adapter; it takes `adapter` (its folder "
                              "or Hub id) and `base` (the alias of the model it goes on)")
    values = {}
    for key in ("adapter", "base"):
        value = fields.get(key)
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value.strip():
            what = "its folder or Hub id" if key == "adapter" else "the alias of the declared model it goes on"
            raise _pipeline_error(f"{where}.{key}", f"a LoRA adapter needs `{key}`: {what}")
        values[key] = value.strip()
    return AdapterSpec(adapter=values["adapter"], base=values["base"])


def _quantize_spec(alias: str, fields: Mapping[object, object]) -> QuantizeSpec:
    """`QuantizeSpec` from a ``{base: ..., quantize: ...}`` mapping, each mistake one pipeline problem."""
    where = f"models.{alias}"
    if "quantize" not in fields:
        raise _pipeline_error(where, "a model given as a mapping is a LoRA adapter, {adapter: <folder or Hub id>, "
                              "base: <alias>}, or a quantized view, {base: <alias>, quantize: int8}")
    extra = sorted(str(k) for k in fields if k not in ("base", "quantize"))
    if extra:
        raise _pipeline_error(where, f"unknown field {extra[0]!r} of a quantized view; it takes `base` (the alias of "
                              "the model to quantize) and `quantize` (the scheme)")
    base, scheme = fields.get("base"), fields.get("quantize")
    if not isinstance(base, str) or not base.strip():
        raise _pipeline_error(f"{where}.base", "a quantized view needs `base`: the alias of the declared model whose "
                              "weights it quantizes")
    try:
        return QuantizeSpec(base=base.strip(), quantize=scheme.strip() if isinstance(scheme, str) else str(scheme))
    except QuantizeError as exc:
        raise _pipeline_error(f"{where}.quantize", str(exc)) from exc


def _check_view_bases(models: Mapping[str, str | AdapterSpec | QuantizeSpec]) -> None:
    """Each quantized view's base is a declared model that is neither an adapter nor a view, else QuantizeBaseError.

    Raised as itself, as `_check_adapter_bases` does: `orchestra run` prints its one line.
    """
    plain = [alias for alias, target in models.items() if isinstance(target, str)]
    for alias, target in models.items():
        if not isinstance(target, QuantizeSpec):
            continue
        if target.base not in models or target.base == alias:
            raise QuantizeBaseError(
                f"models.{alias}: the quantized view's base {target.base!r} is not a declared model"
                f"{_did_you_mean(target.base, plain)}: set `base` to one of {', '.join(plain) or '(none)'}, or "
                f"declare {target.base!r} in models"
            )
        if not isinstance(models[target.base], str):
            raise QuantizeBaseError(
                f"models.{alias}: the quantized view's base {target.base!r} is {_kind(models[target.base])}, not a "
                f"model of its own: set `base` to one of {', '.join(plain) or '(none)'}"
            )


def _kind(target: str | AdapterSpec | QuantizeSpec) -> str:
    return "a LoRA adapter" if isinstance(target, AdapterSpec) else "a quantized view"


def _check_adapter_bases(models: Mapping[str, str | AdapterSpec | QuantizeSpec]) -> None:
    """Each adapter's base is a declared model that is not an adapter itself, else AdapterBaseError.

    Raised as itself, not as a validation problem: it is a model-reference error (`orchestra run` prints
    its one line), the same the registry raises for an adapter given to it directly.
    """
    plain = [alias for alias, target in models.items() if isinstance(target, str)]
    for alias, target in models.items():
        if not isinstance(target, AdapterSpec):
            continue
        if target.base not in models:
            raise AdapterBaseError(
                f"models.{alias}: the LoRA adapter's base {target.base!r} is not a declared model"
                f"{_did_you_mean(target.base, plain)}: set `base` to one of {', '.join(plain) or '(none)'}, or "
                f"declare {target.base!r} in models"
            )
        if isinstance(models[target.base], AdapterSpec):
            raise AdapterBaseError(
                f"models.{alias}: the LoRA adapter's base {target.base!r} is an adapter itself: set `base` to the "
                f"model both were trained on ({', '.join(plain) or 'declare it in models'})"
            )
        if isinstance(models[target.base], QuantizeSpec):
            raise AdapterBaseError(
                f"models.{alias}: the LoRA adapter's base {target.base!r} is a quantized view: set `base` to the "
                f"model it was trained on ({', '.join(plain) or 'declare it in models'})"
            )


def _unknown(what: str, value: str, known: Mapping[str, object]) -> str:
    return (f"{what} {value!r}, which is not declared in `models`{_did_you_mean(value, list(known))}; "
            f"declared: {', '.join(known)}")


# -- turning pydantic's errors into problems that name the agent and the field -----------------------------------

def _strip(message: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unwrap(annotation: object) -> object:
    """The model class inside Optional[...], list[...], dict[..., ...] or Annotated[...], else the annotation."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            inner = _unwrap(arg)
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
        return annotation
    if origin in (list, tuple, dict, set, frozenset) or origin in (Sequence, Mapping):
        args = typing.get_args(annotation)
        return _unwrap(args[-1]) if args else annotation
    return annotation


def _model_at(root: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    current: object = root
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            current = _unwrap(current.model_fields[part].annotation)
        # anything else is an index or a key into a container, already unwrapped to its items
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _describe(err: ErrorDetails, root: type[BaseModel]) -> tuple[str, str]:
    """(field, message) of one pydantic error, relative to ``root``."""
    loc = tuple(err["loc"])
    field = ".".join(str(p) for p in loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        name = str(loc[-1])
        parent = _model_at(root, loc[:-1])
        candidates = list(parent.model_fields) if parent is not None else []
        close = suggest(name, candidates) if candidates else None
        return field, f"unknown field {name!r}" + (f"; did you mean {close!r}?" if close else "; remove it")
    if kind == "missing":
        return field, "required field is missing; add it"
    if kind == "too_short" and loc == ("agents",):
        return field, "a pipeline needs at least one agent"
    message = _strip(err["msg"])
    if kind not in {"value_error", "assertion_error"} and "got " not in message and "input" in err:
        message += f" (got {_shown(err['input'])})"
    return field, message


def _agent_name_at(data: object, index: int | str) -> str | None:
    agents = data.get("agents") if isinstance(data, Mapping) else getattr(data, "agents", None)
    if not isinstance(agents, Sequence) or not isinstance(index, int) or not 0 <= index < len(agents):
        return None
    entry = agents[index]
    name = entry.get("name") if isinstance(entry, Mapping) else getattr(entry, "name", None)
    if name is None and isinstance(entry, Mapping):
        name = entry.get("builtin")
    return name if isinstance(name, str) else None


def _problems(exc: ValidationError, root: type[BaseModel], data: object) -> list[PipelineProblem]:
    problems: list[PipelineProblem] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        base = ".".join(str(p) for p in loc)
        ctx = err.get("ctx") or {}
        # where in the input the agent is: a pipeline's agents.N, or the node itself
        agent_loc: tuple[int | str, ...] | None = None
        if issubclass(root, PipelineSpec) and len(loc) >= 2 and loc[0] == "agents":
            agent_loc = loc[:2]
        elif issubclass(root, AgentNode):
            agent_loc = ()
        agent: str | None = ctx.get("agent")
        if agent is None and agent_loc is not None:
            agent = (_agent_name_at(data, loc[1]) if agent_loc else
                     (data.get("name") or data.get("builtin") if isinstance(data, Mapping) else None))
        nested = ctx.get("error")
        if err["type"] == "value_error" and isinstance(nested, PipelineValidationError) and nested.problems:
            # a nested pipeline model (an agent given as a mapping) already described its problems
            for problem in nested.problems:
                location = ".".join(filter(None, (base, problem.location or problem.field)))
                problems.append(dataclasses.replace(problem, location=location or None))
            continue
        if err["type"] == _AGENT_ERROR:
            for field, message in ctx["problems"]:
                problems.append(PipelineProblem(message, field=field, agent=agent,
                                                location=".".join(filter(None, (base, field)))))
            continue
        if err["type"] == _PIPELINE_ERROR:
            problems.append(PipelineProblem(ctx["detail"], field=ctx["field"], agent=agent))
            continue
        field, message = _describe(err, root)
        if agent_loc is not None:
            field = ".".join(str(p) for p in loc[len(agent_loc):])
        problems.append(PipelineProblem(message, field=field or None, agent=agent, location=base or None))
    return problems


# -- files ------------------------------------------------------------------------------------------------------

def load_pipeline(path: str | os.PathLike[str]) -> PipelineSpec:
    """Read a pipeline from a .yaml/.yml/.json file; any mistake is a PipelineError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise PipelineFileError(f"pipeline file {path} does not exist", path=path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PipelineFileError(f"cannot read the pipeline file: {exc.strerror or exc}", path=path) from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        kind = "a binary file" if b"\x00" in raw[:8192] else "not UTF-8 text"
        raise PipelineFileError(f"{kind} (byte 0x{raw[exc.start]:02x} at offset {exc.start}); a pipeline file is "
                                "YAML or JSON saved as UTF-8", path=path) from exc
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except (json.JSONDecodeError, ValueError) as exc:
        raise PipelineFileError(f"not valid JSON: {exc}", path=path) from exc
    except Exception as exc:  # yaml.YAMLError carries line/column in its message
        raise PipelineFileError(f"not valid YAML: {exc}", path=path) from exc
    if not isinstance(data, dict):
        raise PipelineFileError("expected a mapping with `models` and `agents` at the top level", path=path)
    try:
        with _imports_from(path.parent):  # steps and tools named 'module:function' next to the file
            return PipelineSpec.model_validate(data)
    except PipelineValidationError as exc:
        raise exc.with_path(path) from exc
    except PipelineError as exc:  # graph errors (unknown upstream, cycle) keep their type, gain the file
        raise type(exc)(f"{path}: {exc}") from exc


@contextlib.contextmanager
def _imports_from(folder: Path) -> Iterator[None]:
    """`folder` first on the import path while a pipeline file is validated (its own modules win)."""
    import sys

    entry = str(folder.resolve())
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def pipeline_mermaid(spec: PipelineSpec) -> str:
    """The mermaid flowchart of a validated pipeline, each agent labelled ``alias: member``.

    One function for `orchestra graph` and `Pipeline.graph()`, so both draw the same picture.
    """
    from orchestra.pipelines.graph import build_graph, to_mermaid

    labels = {a.name: f"{a.model}: {spec.models[a.model]}" for a in spec.agents}
    labels.update({s.name: f"step: {s.call if s.call != '<python>' else 'python'}" for s in spec.steps})
    return to_mermaid(build_graph(spec.upstreams(), labels), spec.source_alias)
