"""Pipeline definitions: a typed model loadable from YAML/JSON or built in Python.

Validation happens before any model loads; errors name the file, the field and the fix.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mappings.repair import RepairPolicy
from orchestra.errors import PipelineFileError
from orchestra.gates import GatePolicy

__all__ = ["AgentNode", "MappingPolicy", "PipelineSpec", "load_pipeline"]


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


class AgentNode(BaseModel):
    """One agent in the pipeline: what it does (a spec or a built-in), on which model, reading which upstreams."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="Unique agent name; upstream references and task templates use it.")
    model: str = Field(description="Alias of a model declared in the pipeline's `models`.")
    builtin: str | None = Field(None, description="Name of a built-in agent from `agents.builtin` (e.g. summarizer).")
    args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the built-in agent.")
    spec: dict[str, Any] | None = Field(None, description="Inline AgentSpec fields (role, task, generation, output).")
    upstream: list[str] = Field(default_factory=list, description="Agents whose outputs this agent reads.")
    gate: GatePolicy | None = Field(None, description="Gate policy for this agent (default: the pipeline's).")
    timeout_s: float | None = Field(None, gt=0, description="Give up on this agent after this many seconds.")

    @model_validator(mode="after")
    def _one_definition(self) -> AgentNode:
        if (self.builtin is None) == (self.spec is None):
            raise ValueError(f"agent {self.name!r}: give exactly one of `builtin` or `spec`")
        return self

    def agent_spec(self):
        """Build the `agents.AgentSpec` (imports the agents package)."""
        from agents import AgentSpec, builtin

        if self.builtin is not None:
            factory = getattr(builtin, self.builtin, None)
            if factory is None or self.builtin.startswith("_") or not callable(factory):
                known = [n for n in getattr(builtin, "__all__", []) if n]
                raise PipelineFileError(
                    f"agent {self.name!r}: unknown builtin {self.builtin!r}; known: {', '.join(known)}"
                )
            spec = factory(**self.args)
            return spec.model_copy(update={"name": self.name})
        return AgentSpec.model_validate({**self.spec, "name": self.name})


class PipelineSpec(BaseModel):
    """A whole pipeline: the family's models by alias, the agents, the source, gates and mapping policy."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("pipeline", description="A name for reports and logs.")
    models: dict[str, str] = Field(description="Alias -> family member name or role, or a local model folder.")
    source: str | None = Field(None, description="Alias of the model that prefills the document (default: the most used).")
    devices: dict[str, str] = Field(default_factory=dict, description="Alias -> 'cpu', 'cuda:N' or 'auto'.")
    default_device: str = Field("auto", description="Device for models not listed in `devices`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Runtime dtype of every model.")
    agents: list[AgentNode] = Field(min_length=1, description="The agents; order does not matter, upstreams do.")
    gate: GatePolicy = Field(default_factory=GatePolicy, description="Default gate policy for agents on mapped caches.")
    mapping: MappingPolicy = Field(default_factory=MappingPolicy, description="Mapping store and on-demand calibration.")
    store_budget_mb: int = Field(4096, ge=1, description="Byte budget of the document KV store, MiB.")
    max_concurrency_per_device: int = Field(1, ge=1, description="Agents running at once on one device.")

    @field_validator("agents")
    @classmethod
    def _unique_names(cls, agents: list[AgentNode]) -> list[AgentNode]:
        seen: set[str] = set()
        for agent in agents:
            if agent.name in seen:
                raise ValueError(f"two agents are named {agent.name!r}; agent names must be unique")
            seen.add(agent.name)
        return agents

    @model_validator(mode="after")
    def _models_declared(self) -> PipelineSpec:
        for agent in self.agents:
            if agent.model not in self.models:
                raise ValueError(_unknown("agent " + repr(agent.name) + " uses model", agent.model, self.models))
        if self.source is not None and self.source not in self.models:
            raise ValueError(_unknown("source", self.source, self.models))
        for alias in self.devices:
            if alias not in self.models:
                raise ValueError(_unknown("devices names model", alias, self.models))
        return self

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
        return {agent.name: list(agent.upstream) for agent in self.agents}

    def agent(self, name: str) -> AgentNode:
        return next(a for a in self.agents if a.name == name)


def _unknown(what: str, value: str, known) -> str:
    close = difflib.get_close_matches(value, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{what} {value!r}, which is not declared in `models`{hint}; declared: {', '.join(known)}"


def _format_validation(path: Path, exc: ValidationError) -> str:
    lines = [f"{path}: the pipeline does not validate:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            field = str(err["loc"][-1])
            parent = PipelineSpec
            candidates = list(parent.model_fields) + list(AgentNode.model_fields) + list(GatePolicy.model_fields)
            close = difflib.get_close_matches(field, candidates, n=1)
            msg = f"unknown field {field!r}" + (f"; did you mean {close[0]!r}?" if close else "; remove it")
        elif err["type"] == "missing":
            msg = "required field is missing; add it"
        lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def load_pipeline(path: str | Path) -> PipelineSpec:
    """Read a pipeline from a .yaml/.yml/.json file."""
    path = Path(path)
    if not path.is_file():
        raise PipelineFileError(f"pipeline file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except (json.JSONDecodeError, ValueError) as exc:
        raise PipelineFileError(f"{path}: not valid JSON: {exc}") from exc
    except Exception as exc:  # yaml.YAMLError carries line/column in its message
        raise PipelineFileError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise PipelineFileError(f"{path}: expected a mapping with `models` and `agents` at the top level")
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as exc:
        raise PipelineFileError(_format_validation(path, exc)) from exc
