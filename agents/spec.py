"""`AgentSpec`: what one agent is (role, task template, generation settings, output kind).

A task template references upstream agents' outputs by name, either ``str.format`` style
(``{summarizer}``; write ``{{``/``}}`` for literal braces) or ``$``-style (``$summarizer`` or
``${key-facts}``; write ``$$`` for a literal dollar). Only plain names are allowed: no attribute
access, indexing, conversions or format specs. The names a template needs are
``spec.required_inputs()``; rendering without one of them raises `UnknownUpstreamError`.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)

from agents.errors import InvalidTemplateError, UnknownUpstreamError
from agents.references import colon_form, import_reference
from agents.schema import check_schema, schema_errors
from agents.tools import Tool
from mappings.repair import RepairPolicy

__all__ = [
    "AGENT_NAME_PATTERN",
    "ParsedOutput",
    "MAX_NEW_TOKENS",
    "MaxNewTokens",
    "GenerationSettings",
    "OutputSpec",
    "AgentSpec",
    "TemplateSyntax",
    "upstream_text",
    "escape_template",
]

AGENT_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]*$"
_NAME_RE = re.compile(AGENT_NAME_PATTERN)

TemplateSyntax = Literal["format", "dollar"]

MAX_NEW_TOKENS = 32768
"""The most tokens one agent may generate. Far above what a small family member writes usefully, and
low enough that a typo (an extra zero, 1e8) is refused when the spec is built instead of decoding for
hours or overflowing every context check."""


def _check_max_new_tokens(value: int) -> int:
    if not 1 <= value <= MAX_NEW_TOKENS:
        raise ValueError(
            f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS} (the most tokens one agent may "
            f"generate); got {value}"
        )
    return value


MaxNewTokens = Annotated[
    int,
    AfterValidator(_check_max_new_tokens),
    WithJsonSchema({"type": "integer", "minimum": 1, "maximum": MAX_NEW_TOKENS}),
]
"""A generation budget: an int from 1 to MAX_NEW_TOKENS, refused with a message that says the bound."""


class _DollarTemplate(string.Template):
    """``$name`` (identifier) or ``${name-with-hyphens}``; case-sensitive."""

    flags = re.ASCII
    idpattern = r"[A-Za-z_][A-Za-z0-9_]*"
    braceidpattern = r"[A-Za-z_][A-Za-z0-9_-]*"


# A parsed template: literal text and placeholder names, in order.
_Segment = tuple[Literal["text", "ref"], str]


def _parse_format(template: str) -> list[_Segment]:
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InvalidTemplateError(f"task template is not valid str.format syntax: {exc}; write {{{{ and }}}} "
                                   f"for literal braces") from exc
    segments: list[_Segment] = []
    for literal, field, fmt, conversion in parts:
        if literal:
            segments.append(("text", literal))
        if field is None:
            continue
        if not field or not _NAME_RE.match(field) or fmt or conversion:
            shown = "{" + field + (f"!{conversion}" if conversion else "") + (f":{fmt}" if fmt else "") + "}"
            raise InvalidTemplateError(
                f"task template placeholder {shown} is not supported: use {{agent_name}} with a plain agent "
                f"name (letters, digits, _ or -), and {{{{ }}}} for literal braces"
            )
        segments.append(("ref", field))
    return segments


def _parse_dollar(template: str) -> list[_Segment]:
    segments: list[_Segment] = []
    pos = 0
    for match in _DollarTemplate.pattern.finditer(template):
        if match.start() > pos:
            segments.append(("text", template[pos : match.start()]))
        pos = match.end()
        if match.group("escaped") is not None:
            segments.append(("text", "$"))
        elif match.group("invalid") is not None:
            raise InvalidTemplateError(
                f"task template has a bare '$' at offset {match.start()}: use $name, ${{name}} or $$ for a "
                f"literal dollar"
            )
        else:
            segments.append(("ref", match.group("named") or match.group("braced")))
    if pos < len(template):
        segments.append(("text", template[pos:]))
    return segments


def escape_template(text: str, syntax: TemplateSyntax = "format") -> str:
    """Escape literal text so that it can be embedded in a task template of the given syntax."""
    if syntax == "format":
        return text.replace("{", "{{").replace("}", "}}")
    return text.replace("$", "$$")


def upstream_text(value: object) -> str:
    """The text an upstream output contributes to a prompt (JSON for structured outputs)."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class GenerationSettings(BaseModel):
    """How tokens are chosen and when generation stops."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: MaxNewTokens = 256
    """Upper bound on generated tokens, 1 to MAX_NEW_TOKENS (the context check counts this in full)."""
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    """0 means greedy decoding; above 0, logits are divided by it before sampling."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int | None = Field(None, ge=1)
    """If set, sample only among the k most likely tokens."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the output is cut before the first one."""
    seed: int | None = None
    """Seed of the sampling generator (same seed, same model, same prompt: same tokens); None: random."""
    repetition_penalty: float = Field(1.0, ge=1.0, le=2.0)
    """Penalty on tokens this reply already generated (CTRL-style; 1.0: off); the document is never penalized."""
    no_repeat_ngram_size: int = Field(0, ge=0, le=64)
    """Forbid generating any n-gram of this many tokens twice in one reply (0: off); stops verbatim loops."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: object) -> object:
        return (value,) if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _import_model(path: str) -> type[BaseModel]:
    path = colon_form(path)
    try:
        obj = import_reference(path, what="output model")
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot import output model {path!r}: {exc}; give it as 'package.module:ClassName'") \
            from exc
    if not (isinstance(obj, type) and issubclass(obj, BaseModel)):
        raise ValueError(f"output model {path!r} is not a pydantic model class")
    return obj


ParsedOutput = BaseModel | dict[str, object]
"""A JSON agent's validated reply: an instance of its output model, or the object itself (schema outputs)."""


class OutputSpec(BaseModel):
    """What the agent's output must be: free text, or a JSON object validated by a model or schema."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    kind: Literal["text", "json"] = "text"
    """"text": the output is free text; "json": the first JSON object in it is parsed and validated."""
    model: type[BaseModel] | None = None
    """Pydantic model the JSON object must validate against (or its import path 'pkg.mod:Class')."""
    json_schema: dict[str, object] | None = None
    """JSON schema the object must satisfy (used when no model is given); see agents.schema."""
    max_repairs: int = Field(1, ge=0, le=5)
    """How many times an invalid or truncated JSON reply is re-generated with a repair instruction."""
    instructions: str | None = None
    """Format instructions appended to the task; default: generated from the model or schema."""
    constrained: bool = True
    """Decode under a grammar of the JSON schema (xgrammar), so the reply cannot be malformed JSON."""
    grounded: bool = False
    """Every string item must be a verbatim span of the document; ungrounded list items are dropped (agents.grounding)."""
    max_items: int | None = Field(None, ge=1)
    """Under the grammar, lists in the reply end after this many items (None: as the schema allows)."""

    @field_validator("model", mode="before")
    @classmethod
    def _model_from_path(cls, value: object) -> object:
        return _import_model(value) if isinstance(value, str) else value

    @field_validator("json_schema")
    @classmethod
    def _schema_ok(cls, value: dict[str, object] | None) -> dict[str, object] | None:
        if value is not None:
            check_schema(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> OutputSpec:
        if self.kind == "text" and (self.model is not None or self.json_schema is not None):
            raise ValueError("a model or json_schema needs kind='json'")
        if self.model is not None and self.json_schema is not None:
            raise ValueError("give either a pydantic model or a json_schema, not both")
        if self.grounded and self.kind != "json":
            raise ValueError("grounded=True needs kind='json' (it checks the reply's string items)")
        return self

    @field_serializer("model")
    def _model_path(self, value: type[BaseModel] | None) -> str | None:
        return None if value is None else f"{value.__module__}:{value.__qualname__}"

    def schema_dict(self) -> dict[str, object] | None:
        """The JSON schema of the expected object (from the model if given)."""
        if self.model is not None:
            return self.model.model_json_schema()
        return self.json_schema

    def format_instructions(self) -> str:
        """Text appended to the task that says how to format the reply ('' for free text)."""
        if self.kind == "text":
            return ""
        copy = " Copy each item word for word from the document." if self.grounded else ""
        if self.instructions is not None:
            return self.instructions + copy
        schema = self.schema_dict()
        if schema is None:
            return "Reply with only a JSON object and nothing else." + copy
        compact = json.dumps(_strip_titles(schema), separators=(",", ":"), ensure_ascii=False)
        return f"Reply with only a JSON object that follows this JSON schema, and nothing else:\n{compact}{copy}"

    def validate_value(self, value: object) -> ParsedOutput:
        """Validate a parsed JSON object: a model instance, or the object itself; ValueError if invalid."""
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {type(value).__name__}")
        if self.model is not None:
            return self.model.model_validate(value)
        if self.json_schema is not None:
            problems = schema_errors(value, self.json_schema)
            if problems:
                raise ValueError("; ".join(problems[:5]))
        return value


def _strip_titles(node: object) -> object:
    """Pydantic schemas carry 'title' on every node; drop them to keep prompts short."""
    if isinstance(node, dict):
        return {k: _strip_titles(v) for k, v in node.items() if k != "title" or isinstance(v, dict)}
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


class AgentSpec(BaseModel):
    """One agent: a name, system instructions, a task template over upstream outputs, and policies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=AGENT_NAME_PATTERN)
    """Unique agent name; downstream templates reference this agent's output by it."""
    role: str = "You are a careful assistant that analyses documents."
    """System instructions (the system message when the model has a chat template)."""
    task: str = Field(min_length=1)
    """Task template; references upstream outputs as {name} (or $name with template_syntax='dollar')."""
    template_syntax: TemplateSyntax = "format"
    """'format' for {name} placeholders, 'dollar' for $name / ${name} placeholders."""
    generation: GenerationSettings = GenerationSettings()
    """Decoding settings (max tokens, temperature, top-p/top-k, stop strings, seed, repetition control)."""
    output: OutputSpec = OutputSpec()
    """Output kind (text or validated JSON) and the repair budget."""
    tools: tuple[Tool, ...] = ()
    """Functions the agent may call before it answers (`agents.tools`): `Tool`s, functions, or 'module:function'."""
    max_tool_rounds: int = Field(3, ge=1, le=10)
    """Tool calls the agent may make; after them it must answer."""
    tool_choice: Literal["auto", "required"] = "auto"
    """auto: each round the agent calls a tool or answers; required: its first round must be a call."""
    mapped_repair: RepairPolicy | None = None
    """Repair of a mapped document cache before this agent reads it (None: the pipeline's `mapping.repair`);
    an agent that quotes the document's details spends some of its member's own compute on them."""

    _segments: list[_Segment] = PrivateAttr(default_factory=list)

    @field_validator("tools", mode="before")
    @classmethod
    def _as_tools(cls, value: object) -> object:
        if value is None:
            return ()
        if isinstance(value, (str, Tool)) or callable(value):
            value = [value]
        if isinstance(value, (list, tuple)):
            return tuple(item if isinstance(item, Tool) else Tool.of(item) if isinstance(item, str) or callable(item)
                         else Tool.model_validate(item) for item in value)
        return value

    @model_validator(mode="after")
    def _tools_answer_in_text(self) -> AgentSpec:
        if self.tools and self.output.kind != "text":
            raise ValueError(f"agent {self.name!r}: an agent with tools answers in text (its calls are the JSON); "
                             "drop `tools` or use output kind text")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"agent {self.name!r}: two tools share a name ({names}); name them apart")
        return self

    @model_validator(mode="after")
    def _parse_task(self) -> AgentSpec:
        parse = _parse_format if self.template_syntax == "format" else _parse_dollar
        try:
            self._segments = parse(self.task)
        except InvalidTemplateError as exc:
            raise ValueError(f"agent {self.name!r}: {exc}") from exc
        return self

    def required_inputs(self) -> tuple[str, ...]:
        """Names of the upstream outputs the task template references, in order of first use."""
        return tuple(dict.fromkeys(name for kind, name in self._segments if kind == "ref"))

    def render_task(self, upstream: Mapping[str, object] | None = None) -> str:
        """The task with upstream outputs filled in; UnknownUpstreamError if one is missing."""
        upstream = upstream or {}
        missing = [name for name in self.required_inputs() if name not in upstream]
        if missing:
            raise UnknownUpstreamError(self.name, missing, upstream.keys())
        return "".join(text if kind == "text" else upstream_text(upstream[text]) for kind, text in self._segments)

    def with_generation(self, **changes: object) -> AgentSpec:
        """A copy with some generation settings changed (validated)."""
        settings = GenerationSettings.model_validate({**self.generation.model_dump(), **changes})
        return self.model_copy(update={"generation": settings})
