"""`Pipeline`: build, check, draw and run a pipeline from Python, as fully as a YAML file can.

    from orchestra import Pipeline

    p = Pipeline("brief")                                   # the bundled family, source: root
    p.agent("summarizer", model="root", max_words=80)       # a built-in and its arguments
    p.agent("key_facts", model="finetuned", max_facts=4)
    p.agent("critic", model="distilled", target_agent="summarizer")   # reads {summarizer}: upstream implied
    report = p.run_sync(document)                           # or: await p.run(document); async for e in p.stream(document)

The builder is a thin layer over `PipelineSpec`, in the manner of LangGraph's StateGraph: every
`agent(...)` call validates that agent at once (a `PipelineError` naming the agent and the field),
`spec` / `to_spec()` assembles and checks the whole `PipelineSpec` (upstreams, cycles), and a YAML
file loads into the same object (`Pipeline.from_file`), so the two ways of writing a pipeline cannot
drift apart.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from agents.bridge import run_blocking
from agents.spec import AgentSpec
from orchestra.errors import (
    FamilyError,
    PipelineProblem,
    PipelineValidationError,
    SessionError,
)
from orchestra.familycache.gates import GatePolicy
from orchestra.models.modelref import AdapterSpec, QuantizeSpec
from orchestra.pipelines.inputs import InputSpec
from orchestra.pipelines.spec import (
    AgentNode,
    ChunkingPolicy,
    ExecutorSpec,
    KVStoreSettings,
    MappingPolicy,
    PipelineSettings,
    PipelineSpec,
    load_pipeline,
    suggest,
)
from orchestra.pipelines.steps import Condition, StepNode, WhenLike
from orchestra.runs import refuse_inside_event_loop
from orchestra.runs.checkpoint import Checkpointer, SqliteCheckpointer

if TYPE_CHECKING:
    from orchestra.family.manifest import FamilyManifest
    from orchestra.observability.events import Event
    from orchestra.observability.report import RunReport
    from orchestra.runs.scheduler import Orchestra
    from orchestra.runs.session import Session

    EventSink = Callable[[Event], Awaitable[None] | None]
    """Called with every event of a run; may be a coroutine function."""

__all__ = ["Pipeline", "BUNDLED_ROLES"]

BUNDLED_ROLES: tuple[str, ...] = ("root", "finetuned", "quantized", "distilled", "int8")
"""The roles of the bundled family's members; without a loaded family, a Pipeline's default aliases."""


class Pipeline:
    """A pipeline under construction, and the way to run it.

    ``Pipeline(name, source="root", *, family=None, home=None, models=None, gate=None, mapping=None,
    devices=None, default_device="auto", dtype="auto", store_budget_mb=4096,
    max_concurrency_per_device=1, executor=None, kv_store=None, chunking=None)``:

    - ``family``: a loaded `FamilyManifest`; default: the family under ``home`` (else
      ``$ORCHESTRA_HOME``, else ``~/.cache/orchestra``), loaded lazily at the first run, so building and
      validating a pipeline never needs it.
    - ``models``: alias -> family member (role or name), a local Hugging Face model folder, a Hub id
      ``org/name[@revision]`` (fetched into the Hugging Face cache; docs/pipelines.md), or a LoRA adapter
      over another alias, ``AdapterSpec(adapter=folder_or_id, base=alias)`` or
      ``{"adapter": ..., "base": ...}`` (its base's weights are shared, held once), or a quantized view of
      another alias, ``QuantizeSpec(base=alias, quantize="int8")`` or ``{"base": ..., "quantize": "int8"}``
      (the base's weights loaded again and quantized by torchao: the ``quant`` extra). By default
      every member role is an alias of itself (``root``, ``finetuned``, ``quantized``, ``distilled``; a
      given family's roles), so ``model="finetuned"`` just works; ``models`` adds aliases or overrides
      these. The built spec keeps the aliases that agents, the source or ``devices`` use, plus every
      alias given in ``models`` and the base of every adapter or quantized view kept.
    - ``source``: the alias that prefills the document (None: the model most agents use).
    - ``executor``: where model work runs: ``"local"`` (default), ``"ray"``, or an `ExecutorSpec` / mapping
      (``{"kind": "ray", "members": {"finetuned": {"num_gpus": 1, "replicas": 2}}}``; docs/scale-out.md).
    - ``chunking``: documents longer than a window (`ChunkingPolicy`, or a mapping such as
      ``{"mode": "always", "window_tokens": 2048}``): cut into chunks, each prefilled once and shared;
      agents map over the chunks and reduce (docs/long-documents.md).
    - the rest are `PipelineSpec`'s fields of the same names (gate policy, mapping policy, devices,
      dtype, KV store budget, per-device concurrency).

    A bad setting raises `PipelineValidationError` here. One `Orchestra` (models, KV store, mappings)
    is made at the first run and reused by later runs, until an agent is added.
    """

    def __init__(
        self,
        name: str,
        source: str | None = "root",
        *,
        family: FamilyManifest | None = None,
        home: str | os.PathLike[str] | None = None,
        models: Mapping[str, str | os.PathLike[str] | AdapterSpec | QuantizeSpec | Mapping[str, str]] | None = None,
        gate: GatePolicy | Mapping[str, object] | None = None,
        mapping: MappingPolicy | Mapping[str, object] | None = None,
        devices: Mapping[str, str] | None = None,
        default_device: str = "auto",
        dtype: str = "auto",
        store_budget_mb: int = 4096,
        max_concurrency_per_device: int = 1,
        executor: ExecutorSpec | Mapping[str, object] | str | None = None,
        kv_store: KVStoreSettings | Mapping[str, object] | None = None,
        chunking: ChunkingPolicy | Mapping[str, object] | None = None,
    ) -> None:
        self._family = family
        self._home = home
        declared = {alias: os.fspath(target) if isinstance(target, os.PathLike) else target
                    for alias, target in (models or {}).items()}
        self._declared = set(declared)  # aliases the user asked for: always kept in the spec
        self._models: dict[str, str | AdapterSpec | QuantizeSpec] = {}
        settings: dict[str, object] = {
            "name": name, "models": {**_role_aliases(family), **declared}, "source": source,
            "devices": dict(devices or {}),
            "default_device": default_device, "dtype": dtype, "store_budget_mb": store_budget_mb,
            "max_concurrency_per_device": max_concurrency_per_device,
        }
        if gate is not None:
            settings["gate"] = gate
        if mapping is not None:
            settings["mapping"] = mapping
        if executor is not None:
            settings["executor"] = executor
        if kv_store is not None:
            settings["kv_store"] = kv_store
        if chunking is not None:
            settings["chunking"] = chunking
        self._settings = PipelineSettings(**settings)
        self._models = dict(self._settings.models)  # validated: mappings made AdapterSpecs and QuantizeSpecs
        self._nodes: list[AgentNode] = []
        self._steps: list[StepNode] = []
        self._inputs: dict[str, InputSpec] = {}
        self._spec: PipelineSpec | None = None
        self._orch: Orchestra | None = None
        self._orch_lock = threading.Lock()  # run_sync from several threads makes one Orchestra, not several
        self._checkpointer: Checkpointer | None = None

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: PipelineSpec, *, family: FamilyManifest | None = None,
                  home: str | os.PathLike[str] | None = None) -> Pipeline:
        """The builder for an existing spec: its models exactly (no default aliases added), its agents."""
        settings = {field: getattr(spec, field) for field in PipelineSettings.model_fields}
        name, source = settings.pop("name"), settings.pop("source")
        pipeline = cls(name, source, family=family, home=home, **settings)
        pipeline._models = dict(spec.models)
        pipeline._declared = set(spec.models)
        pipeline._settings = PipelineSettings(**{field: getattr(spec, field) for field in PipelineSettings.model_fields})
        pipeline._nodes = list(spec.agents)
        pipeline._steps = list(spec.steps)
        pipeline._inputs = dict(spec.inputs)
        pipeline._spec = spec
        return pipeline

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, family: FamilyManifest | None = None,
                  home: str | os.PathLike[str] | None = None) -> Pipeline:
        """Load a .yaml/.yml/.json pipeline file (`load_pipeline`): the same object the Python API builds."""
        return cls.from_spec(load_pipeline(path), family=family, home=home)

    def agent(
        self,
        agent: str | AgentSpec | Mapping[str, object],
        model: str = "root",
        name: str | None = None,
        after: str | Sequence[str] | None = None,
        gate: GatePolicy | Mapping[str, object] | None = None,
        timeout_s: float | None = None,
        when: WhenLike | Mapping[str, object] | None = None,
        per_chunk: bool | None = None,
        chunks: int | str | None = None,
        **builtin_args: object,
    ) -> Pipeline:
        """Add an agent and return the pipeline, so calls chain: ``p.agent(...).agent(...)``.

        - ``agent``: a built-in's name (``agents.builtin.BUILTINS``: summarizer, key_facts,
          question_answerer, critic, report_writer), whose arguments are the keyword arguments
          (``max_words=80``, ``target_agent="summarizer"``); or an `agents.AgentSpec`; or a mapping of
          its fields (``{"task": "Check {summarizer}", "generation": {"max_new_tokens": 64}}``).
        - ``model``: an alias of ``models`` (by default a member role).
        - ``name``: default: the spec's name, or the built-in's own default name (``summarizer``,
          ``key_facts``, ``answer``, ``<target_agent>_critic``, ``report``).
        - ``after``: agents to wait for besides those the task template reads, which are always
          upstreams (so a critic of ``summarizer`` needs no ``after``). Upstream names are checked when
          the whole spec is built (`spec`, `graph`, `run`), so agents may be added in any order.
        - ``gate``: this agent's gate policy (default: the pipeline's); ``timeout_s``: give up after.
        - ``when``: run only if this holds: a callable given the upstream outputs (name -> text), or a
          condition ``{"agent": "triage", "equals": "legal"}`` (`orchestra.pipelines.steps.Condition`); else skipped.
        - ``per_chunk``, ``chunks``: chunked runs (docs/long-documents.md): once per chunk, or once over the
          upstreams' outputs; ``"all"`` chunks or the k most relevant to the task (BM25).

        Raises `PipelineValidationError` at once, naming the agent and the field, for an unknown
        built-in (with a did-you-mean), a bad or missing built-in argument, an out-of-range
        ``max_new_tokens``, a bad template, an undeclared model alias or a duplicate name.
        """
        fields: dict[str, object] = {"model": model, "name": name, "gate": gate, "timeout_s": timeout_s,
                                     "per_chunk": per_chunk, "chunks": chunks,
                                     "upstream": [after] if isinstance(after, str) else after}
        node = _agent_node(agent, builtin_args, {k: v for k, v in fields.items() if v is not None}).with_condition(
            Condition.model_validate(when) if isinstance(when, Mapping) else when)
        _refuse_new_node(node, self._models, {n.name for n in self._nodes} | {n.name for n in self._steps})
        self._nodes.append(node)
        self._changed()
        return self

    def step(self, fn: Callable[..., object], *, name: str | None = None, after: str | Sequence[str] | None = None,
             when: WhenLike | Mapping[str, object] | None = None, timeout_s: float | None = None) -> Pipeline:
        """Add a Python step (sync or async function) and return the pipeline; chains.

        It runs after ``after`` (agents or steps) and receives, by parameter name, ``document``, ``inputs``,
        ``upstream`` (every upstream's output) or any upstream's or input's own name; what it returns is read
        downstream like an agent's output (text, or JSON for anything else). An exception fails the step
        only. ``when`` as for `agent`. A parameter it cannot be given is refused here.
        """
        upstream = [after] if isinstance(after, str) else list(after or [])
        node = StepNode.of(fn, name=name, upstream=upstream, timeout_s=timeout_s,
                           when=Condition.model_validate(when) if isinstance(when, Mapping) else when)
        if node.when is not None and node.when.agent not in node.upstream:
            node.upstream.append(node.when.agent)
        if node.name in {n.name for n in self._nodes} | {n.name for n in self._steps}:
            raise PipelineValidationError(problems=[PipelineProblem(
                f"the pipeline already has a node named {node.name!r}; give this step another `name=`",
                field="name", agent=node.name)])
        self._steps.append(node)
        self._changed()
        return self

    def revise(self, name: str, *, write: str, review: str, model: str = "root", critic_model: str | None = None,
               rounds: int = 2, approve: str = "APPROVED", max_new_tokens: int = 256,
               after: str | Sequence[str] | None = None) -> Pipeline:
        """A bounded writer <-> critic loop, unrolled into the DAG (runs stay acyclic and reproducible); chains.

        ``<name>_draft_1`` writes per ``write`` (a task template; it may read upstreams and inputs), ``<name>_review_1``
        checks it per ``review`` and says ``approve`` when it needs no change; each further draft (up to ``rounds``)
        runs only when the previous review did not approve, and reads the previous draft and review. The step
        ``name`` is the last draft that ran: downstream agents read ``{name}``.
        """
        if rounds < 1:
            raise PipelineValidationError(problems=[PipelineProblem("rounds must be at least 1", field="rounds",
                                                                    agent=name)])
        drafts = _revise_rounds(self, name, write=write, review=review, model=model, critic_model=critic_model,
                                rounds=rounds, approve=approve.strip(), max_new_tokens=max_new_tokens, after=after)

        def last_draft(upstream: dict[str, str]) -> str:
            return upstream[max(upstream, key=lambda n: int(n.rsplit("_", 1)[1]))]

        last_draft.__name__ = name
        self._steps.append(StepNode.of(last_draft, name=name, upstream=drafts, on_upstream_failure="run_with_available"))
        self._changed()
        return self

    def with_input(self, name: str, *, description: str = "", default: str | None = None) -> Pipeline:
        """Declare a runtime input task templates read as ``{name}``; each run gives its value
        (``run(document, inputs={name: ...})``), else `default` (None: a run must give it). Chains."""
        self._inputs[name] = InputSpec(description=description, default=default)
        self._changed()
        return self

    def with_executor(self, kind: str | None = None, *, address: str | None = None) -> Pipeline:
        """This pipeline with its executor's kind and/or Ray address replaced (`orchestra run --executor ray`)."""
        update: dict[str, str] = {}
        if kind is not None:
            update["kind"] = kind
        if address is not None:
            update["address"] = address
        if not update:
            return self
        executor = ExecutorSpec.model_validate({**self._settings.executor.model_dump(), **update})
        self._settings = PipelineSettings(**{**{f: getattr(self._settings, f) for f in PipelineSettings.model_fields},
                                             "executor": executor})
        self._changed()
        return self

    def with_kv_store(self, enabled: bool | None = None, *, directory: str | None = None,
                      budget_mb: int | None = None) -> Pipeline:
        """This pipeline with its disk tier switched on or off, moved or resized (`orchestra run --no-kv-store`)."""
        update: dict[str, object] = {k: v for k, v in (("enabled", enabled), ("directory", directory),
                                                        ("budget_mb", budget_mb)) if v is not None}
        if not update:
            return self
        kv = KVStoreSettings.model_validate({**self._settings.kv_store.model_dump(), **update})
        self._settings = PipelineSettings(**{**{f: getattr(self._settings, f) for f in PipelineSettings.model_fields},
                                             "kv_store": kv})
        self._changed()
        return self

    def with_checkpointer(self, checkpointer: Checkpointer | str | os.PathLike[str] | None) -> Pipeline:
        """Make runs durable: each finished agent is recorded (a `Checkpointer`, or a path: a SQLite file), so
        ``run(..., run_id=...)`` of a run that stopped continues it. None: runs are not recorded."""
        if checkpointer is not None and not isinstance(checkpointer, Checkpointer):
            checkpointer = SqliteCheckpointer(os.fspath(checkpointer))
        self._checkpointer = checkpointer
        self._changed()
        return self

    def _changed(self) -> None:
        self._spec = None
        self._release()
        self._orch = None  # a new pipeline needs a new Orchestra (its specs and graph are fixed at creation)

    def _release(self) -> None:
        close = getattr(self._orch, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """Release the models' executor (a ray executor's actors and placement group); a later run starts again."""
        with self._orch_lock:
            self._release()
            self._orch = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
    # -- what was built ----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._settings.name

    @property
    def source(self) -> str | None:
        return self._settings.source

    @property
    def models(self) -> dict[str, str | AdapterSpec | QuantizeSpec]:
        """Every alias available to agents (a copy): the default role aliases and ``models``."""
        return dict(self._models)

    @property
    def agents(self) -> tuple[AgentNode, ...]:
        return tuple(self._nodes)

    @property
    def spec(self) -> PipelineSpec:
        """The validated `PipelineSpec` (built once per change; see `to_spec`)."""
        return self.to_spec()

    def to_spec(self) -> PipelineSpec:
        """Assemble and validate the whole `PipelineSpec`: what `orchestra run` would run for a file.

        Raises `UnknownAgentError` / `CycleError` for upstream mistakes, `PipelineValidationError` for
        an empty pipeline.
        """
        if self._spec is not None:
            return self._spec
        if not self._nodes:
            raise PipelineValidationError(problems=[PipelineProblem(
                "a pipeline needs at least one agent; add one with Pipeline.agent(...)", field="agents")])
        settings = {field: getattr(self._settings, field) for field in PipelineSettings.model_fields}
        keep = self._declared | {n.model for n in self._nodes} | set(settings["devices"])
        if settings["source"] is not None:
            keep.add(settings["source"])
        keep |= {t.base for a, t in self._models.items() if a in keep and isinstance(t, AdapterSpec | QuantizeSpec)}
        settings["models"] = {alias: target for alias, target in self._models.items() if alias in keep}
        self._spec = PipelineSpec(**settings, agents=list(self._nodes), steps=list(self._steps),
                                  inputs=dict(self._inputs))
        return self._spec

    def graph(self) -> str:
        """The agent DAG as a mermaid flowchart (what `orchestra graph` prints for a file)."""
        from orchestra.pipelines.spec import pipeline_mermaid

        return pipeline_mermaid(self.spec)

    def __repr__(self) -> str:
        agents = ", ".join(f"{n.name}@{n.model}" for n in self._nodes)
        return f"Pipeline({self.name!r}, source={self.source!r}, agents=[{agents}])"

    # -- running -----------------------------------------------------------------------------------------
    def orchestra(self) -> Orchestra:
        """The `Orchestra` that runs this pipeline, made once and reused (loaded models, stored caches)."""
        with self._orch_lock:
            if self._orch is None:
                from orchestra.runs.scheduler import Orchestra

                spec = self.spec
                self._orch = Orchestra(spec, family=self._resolve_family(spec), checkpointer=self._checkpointer)
            return self._orch

    def _resolve_family(self, spec: PipelineSpec) -> FamilyManifest | None:
        if self._family is None:
            self._family = _family_for(spec, self._home)
        return self._family

    @property
    def last_report(self) -> RunReport | None:
        """The report of the latest finished run (also after `stream`)."""
        return self._orch.last_report if self._orch is not None else None

    async def run(self, document: str | os.PathLike[str] | bytes, *, on_event: EventSink | None = None,
                  inputs: Mapping[str, object] | None = None, run_id: str | None = None,
                  resume: bool = False) -> RunReport:
        """Run every agent over ``document`` (its text, or a Path to read); ``on_event`` gets each event.

        ``inputs`` are this run's values of the pipeline's declared inputs (`with_input`). Running the same
        pipeline again (other inputs, same document) reuses its loaded models and the document's caches.
        With a checkpointer (`with_checkpointer`), a ``run_id`` recorded before continues that run (``resume=True``:
        it must exist): what finished is kept, the rest runs.
        """
        return await self.orchestra().run(_text(document), on_event=on_event, inputs=inputs, run_id=run_id,
                                          resume=resume)

    async def stream(self, document: str | os.PathLike[str] | bytes, *, inputs: Mapping[str, object] | None = None,
                     run_id: str | None = None, resume: bool = False) -> AsyncIterator[Event]:
        """Yield the run's typed events as they happen (tokens included); then see `last_report`."""
        async for event in self.orchestra().stream(_text(document), inputs=inputs, run_id=run_id, resume=resume):
            yield event

    def session(self, document: str | os.PathLike[str] | bytes | None = None, *, name: str | None = None,
                input_tokens: int | None = None) -> Session:
        """A session over ``document`` (text or a path): the document held on every member for many runs
        (``with p.session(doc) as s: s.ask(...)``). A ``name`` keeps it in the home (``sessions/<name>.json``);
        ``p.session(name=...)`` without a document reopens it. A document longer than a window is held chunk
        by chunk, cut for questions (input values) of up to ``input_tokens`` tokens each (default 64)."""
        from orchestra.documents.chunking import HOLD_INPUT_TOKENS
        from orchestra.paths import resolve_home
        from orchestra.runs.session import Session, session_path

        path = session_path(resolve_home(self._home), name) if name is not None else None
        if document is None:
            if path is None:
                raise SessionError("give the session a document, or the name of a session kept before")
            return Session.load(self, path, name or "")
        if input_tokens is not None and input_tokens < 0:
            raise SessionError(f"input_tokens is {input_tokens}: give the tokens to keep per question, 0 or more")
        return Session(self, _text(document), name=name, path=path,
                       input_tokens=HOLD_INPUT_TOKENS if input_tokens is None else input_tokens)

    def run_sync(self, document: str | os.PathLike[str] | bytes, *, on_event: EventSink | None = None,
                 inputs: Mapping[str, object] | None = None, run_id: str | None = None,
                 resume: bool = False) -> RunReport:
        """`run` for synchronous code (scripts, notebooks' plain cells): starts and ends its own event loop.

        Inside a running event loop it raises `EventLoopRunningError` instead of blocking that loop:
        use ``await pipeline.run(document)`` there.
        """
        refuse_inside_event_loop()

        return run_blocking(functools.partial(self.run, document, on_event=on_event, inputs=inputs, run_id=run_id,
                                              resume=resume))


def _role_aliases(family: FamilyManifest | None) -> dict[str, str]:
    if family is None:
        return {role: role for role in BUNDLED_ROLES}
    aliases: dict[str, str] = {}
    for record in family.members.values():
        key = record.role if record.role != "external" else record.name
        aliases.setdefault(key, key)
    return aliases


def _outside_family(target: str | AdapterSpec | QuantizeSpec) -> bool:
    """A local model or adapter folder or a Hub id (resolved later, by the registry): one that needs no family.

    An adapter's or a quantized view's base is checked as a model of its own (it is among the aliases used)."""
    from orchestra.models.modelref import ModelRef

    if isinstance(target, AdapterSpec | QuantizeSpec):
        return True
    ref = ModelRef.parse(target)
    return ref.is_hub or (ref.folder / "config.json").is_file() or (ref.folder / "adapter_config.json").is_file()


def _text(document: str | os.PathLike[str] | bytes) -> str:
    """A str is the document's text; a Path (or other PathLike) is a file to read, bytes a file's content: text,
    Markdown, PDF, HTML or DOCX (`orchestra.documents.formats.load_document`)."""
    if isinstance(document, str):
        return document
    from orchestra.documents.formats import load_document

    return load_document(document).text  # unreadable files are an InputFileError / DocumentFormatError saying so


def _agent_node(agent: str | AgentSpec | Mapping[str, object], builtin_args: Mapping[str, object],
                fields: dict[str, object]) -> AgentNode:
    """The node `Pipeline.agent` adds: a built-in with its arguments, or a spec (typed, or its fields)."""
    data = dict(fields)
    name = fields.get("name")
    if isinstance(agent, str):
        data["builtin"] = agent
        data["args"] = dict(builtin_args)
    elif isinstance(agent, (AgentSpec, Mapping)):
        if builtin_args:
            given = agent.name if isinstance(agent, AgentSpec) else agent.get("name")
            shown = name if isinstance(name, str) else (given if isinstance(given, str) else None)
            raise PipelineValidationError(problems=[PipelineProblem(
                f"keyword arguments ({', '.join(builtin_args)}) are a built-in agent's arguments, and this "
                f"agent is a spec: put its settings in the spec", field="args", agent=shown)])
        data["spec"] = agent
    else:
        raise PipelineValidationError(problems=[PipelineProblem(
            f"expected a built-in agent's name, an agents.AgentSpec or a mapping of its fields, not "
            f"{type(agent).__name__}", field="spec", agent=name if isinstance(name, str) else None)])
    return AgentNode.model_validate(data)


def _refuse_new_node(node: AgentNode, models: Mapping[str, object], names: set[str]) -> None:
    """PipelineValidationError when `node` uses a model the pipeline lacks, or a name it already has."""
    problems = []
    if node.model not in models:
        close = suggest(node.model, list(models))
        problems.append(PipelineProblem(
            f"model alias {node.model!r} is not one of this pipeline's models"
            + (f" (did you mean {close!r}?)" if close else "")
            + f"; models: {', '.join(models)}; add it with Pipeline(..., models={{{node.model!r}: ...}})",
            field="model", agent=node.name))
    if node.name in names:
        problems.append(PipelineProblem(
            f"the pipeline already has an agent named {node.name!r}; give this one another `name=`",
            field="name", agent=node.name))
    if problems:
        raise PipelineValidationError(problems=problems)


def _family_for(spec: PipelineSpec, home: str | os.PathLike[str] | None) -> FamilyManifest | None:
    """The family the pipeline's members come from; None when it names only folders and Hub ids (and no family is
    built); FamilyError, saying how to build one, when it needs a family that is not there."""
    from orchestra.family.manifest import load_family

    try:
        return load_family(home)
    except FamilyError:
        used = {a.model for a in spec.agents} | {spec.source_alias}
        used |= {t.base for a, t in spec.models.items() if a in used and isinstance(t, AdapterSpec | QuantizeSpec)}
        if all(_outside_family(spec.models[alias]) for alias in used):
            return None  # only local model folders and Hub ids: no family needed
        raise  # its message says how to build the family


def _revise_rounds(pipeline: Pipeline, name: str, *, write: str, review: str, model: str, critic_model: str | None,
                   rounds: int, approve: str, max_new_tokens: int, after: str | Sequence[str] | None) -> list[str]:
    """Add `Pipeline.revise`'s draft and review agents, round by round; the drafts' names."""
    generation = {"max_new_tokens": max_new_tokens, "repetition_penalty": 1.15, "no_repeat_ngram_size": 6}
    drafts = []
    for k in range(1, rounds + 1):
        draft, check = f"{name}_draft_{k}", f"{name}_review_{k}"
        when: Condition | None = None
        task = write
        if k > 1:
            previous, notes = f"{name}_draft_{k - 1}", f"{name}_review_{k - 1}"
            task = (f"{write}\n\nYour previous draft:\n{{{previous}}}\n\nThe reviewer's notes:\n{{{notes}}}\n\n"
                    "Write an improved version that addresses every note.")
            when = Condition(agent=notes, not_contains=approve)  # approved: no further round
        pipeline.agent({"name": draft, "task": task, "generation": generation}, model=model,
                       after=after if k == 1 else None, when=when)
        pipeline.agent({"name": check, "task": f"{review}\n\nThe draft:\n{{{draft}}}\n\nIf it needs no change, "
                        f"reply with the single word {approve}. Otherwise list what to change.",
                        "generation": generation}, model=critic_model or model)
        drafts.append(draft)
    return drafts
