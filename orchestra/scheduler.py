"""Run a pipeline's DAG over one document; every cache comes from the FamilyCache.

Each agent starts as soon as its own upstreams are done (no supersteps: a slow sibling never holds
back a fast branch). The scheduler prefills nothing, maps nothing and gates nothing itself: it asks
the FamilyCache for the document's cache on the agent's member, re-emits what the cache did as
run events, runs the agent over a private copy, and adds up the report. Each member's prefix is laid out
by its own tokenizer and chat template; a member whose prefix ids differ from the source's (another chat
template) cannot share the source's cache: it prefills its own, and its agents report why as a fallback.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.from_thread
import structlog

from orchestra import events as ev
from orchestra._mapreduce import Combined, Part, combine, notes_document, pointer, round_label
from orchestra.chunking import HOLD_INPUT_TOKENS
from orchestra.errors import ChunkCallError, DocumentError, RunResumeError
from orchestra.familycache import CacheLease, CachePolicy, CacheStep, FamilyCache, make_executor
from orchestra.gates import CircuitBreaker
from orchestra.graph import build_graph
from orchestra.mapstore import MappingStore
from orchestra.paths import resolve_home
from orchestra.pipeline import AgentNode, PipelineSpec
from orchestra.registry import ModelRegistry
from orchestra.report import AgentReport, ChunkCall, ChunkSummary, ModelCacheReport, RunReport
from orchestra.steps import StepNode, WhenLike, call_step, condition_holds

if TYPE_CHECKING:
    from agents.runner import AgentResult
    from agents.spec import AgentSpec
    from mappings.repair import RepairPolicy
    from orchestra.checkpoint import Checkpointer, RunCheckpoint
    from orchestra.family.manifest import FamilyManifest

__all__ = ["Orchestra"]

log = structlog.get_logger("orchestra")
EventSink = Callable[[ev.Event], Awaitable[None] | None]
TokenSink = Callable[..., Awaitable[None]]


@dataclass(frozen=True)
class _MemberPrompt:
    """The document prefix's token ids on one member, and why it cannot reuse the source's cache (None: it can)."""

    ids: list[int]
    own_reason: str | None = None


@dataclass
class _Run:
    run_id: str
    started: float
    prefix_ids: list[int]
    emit: Callable[[ev.Event], Coroutine[object, object, None]]  # a coroutine: anyio.from_thread.run takes no other
    leases: list[tuple[str | None, CacheLease]] = field(default_factory=list)
    charged: set[int] = field(default_factory=set)
    outputs: dict[str, str] = field(default_factory=dict)
    reports: dict[str, AgentReport] = field(default_factory=dict)
    document: str = ""
    inputs: dict[str, str] = field(default_factory=dict)
    """The run's values of the pipeline's declared inputs (defaults filled in)."""
    prompts: dict[str, _MemberPrompt] = field(default_factory=dict)
    """Each member's document prefix (laid out by its own tokenizer and chat template), once per run."""
    restored: dict[str, AgentReport] = field(default_factory=dict)
    """Agents a resumed run keeps from its checkpoint (their outputs are in `outputs` already)."""
    checkpointer: Checkpointer | None = None
    input_room: int = 0
    """Tokens kept per input value when the window is sized (a hold sizes it before any run's inputs exist)."""
    chunks: list[Part] | None = None
    """A chunked run's document chunks (None: the document fits and is one prefix, as always)."""
    window: int = 0
    """A chunked run's window: tokens of each chunk's prefix."""
    chunk_prompts: dict[tuple[str, int, int], _MemberPrompt] = field(default_factory=dict)
    """(member, round, chunk) -> that chunk's prefix on the member."""
    chunk_paths: dict[int, dict[str, str]] = field(default_factory=dict)
    """Document chunk -> model alias -> the cache path it got."""
    source_prefill: dict[int, float] = field(default_factory=dict)
    """Document chunk -> seconds the source spent prefilling it."""
    every_chunk_s: float = 0.0
    """Estimated prefill seconds had every chunk call re-prefilled its chunk."""


def _held_key(document: str) -> str:
    return hashlib.sha256(document.encode("utf-8", "surrogatepass")).hexdigest()


_NOT_IN_RESULTS = {"kv_store", "executor", "store_budget_mb", "max_concurrency_per_device"}
"""Pipeline settings that change where and how fast a run goes, not what it answers (a resume may change them)."""

KV_STORE_ENV = "ORCHESTRA_KV_STORE"
"""Environment: the disk tier's folder for pipelines that name none, or ``off`` (then only a pipeline's own
``kv_store.directory`` turns it on)."""


class Orchestra:
    """A validated pipeline bound to a FamilyCache (its own, or one shared with other pipelines)."""

    def __init__(
        self,
        pipeline: PipelineSpec,
        *,
        family: FamilyManifest | None = None,
        cache: FamilyCache | None = None,
        mappings: MappingStore | None = None,
        breaker: CircuitBreaker | None = None,
        share_prefill: bool = True,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.graph = build_graph(pipeline.upstreams(), {a.name: a.model for a in pipeline.agents})
        self.specs = {a.name: a.agent_spec() for a in pipeline.agents}
        if any(s.output.kind == "json" and s.output.constrained for s in self.specs.values()):
            from agents.constrained import require_grammar

            require_grammar()  # refused before any weights load, never run as a silently different agent
        if family is None and cache is None:
            family = _default_family()
        self.family = family
        self.source_alias = pipeline.source_alias
        if cache is None:
            registry = ModelRegistry(
                pipeline.models, family=family, devices=pipeline.devices, default_device=pipeline.default_device,
                dtype=pipeline.dtype,
            )
            for alias in {a.model for a in pipeline.agents} | {self.source_alias}:
                registry.info(alias)  # missing models are refused here, before any weights load
            registry.check_family(self.source_alias)
            # A pipeline of local folders (no family) keeps its maps and caches in the orchestra home, never in
            # the current directory, where a run would leave a stray `mappings/` behind.
            home = Path(family.home) if family else resolve_home(None)
            if mappings is None:
                directory = pipeline.mapping.directory or str(home / "mappings")
                mappings = MappingStore(Path(directory), on_missing=pipeline.mapping.on_missing,
                                        method=pipeline.mapping.method, tokens=pipeline.mapping.tokens)
            cache = self.cache_for(pipeline, registry, mappings, breaker=breaker, home=home)
        else:
            for alias in {a.model for a in pipeline.agents} | {self.source_alias}:
                cache.info(alias)
        self.cache = cache
        self.share_prefill = share_prefill
        self.checkpointer = checkpointer
        """Where runs record each finished agent (None: runs are not durable and cannot be resumed)."""
        self.last_report: RunReport | None = None
        self._held_windows: dict[str, list[int]] = {}
        """Held documents' digests -> each hold's chunk window (runs over a held document cut its chunks)."""

    @staticmethod
    def cache_for(pipeline: PipelineSpec, registry: ModelRegistry, mappings: MappingStore, *,
                  breaker: CircuitBreaker | None = None, home: Path | None = None) -> FamilyCache:
        """A FamilyCache with the pipeline's budget, probe tail, gates and repair (to share models across pipelines),
        over the pipeline's disk tier (in `home`/kv unless it names a folder; none without a home or a folder)."""
        policy = CachePolicy(budget_bytes=pipeline.store_budget_mb << 20, tail_tokens=max(2, pipeline.mapping.tail_tokens),
                             gate=pipeline.gate, repair=pipeline.mapping.repair,
                             repair_costs=pipeline.mapping.repair_costs)
        # a remote executor starts workers only for the members this pipeline uses
        used = list(dict.fromkeys([pipeline.source_alias, *(a.model for a in pipeline.agents)]))
        executor = make_executor(pipeline.executor.kind, registry, pipeline.executor, members=used, name=pipeline.name,
                                 max_concurrency_per_device=pipeline.max_concurrency_per_device)
        disk = None
        settings = pipeline.kv_store
        env = os.environ.get(KV_STORE_ENV, "")
        off = env.lower() == "off"
        folder = Path(env) if env and not off else home / "kv" if home is not None else None
        directory = Path(settings.directory) if settings.directory else folder
        wanted = settings.enabled if settings.enabled is not None else bool(settings.directory) or not off
        if wanted and directory is not None:
            from orchestra.familycache import KVStore

            disk = KVStore(directory, settings.budget_mb << 20)
        return FamilyCache(executor, mappings, source=pipeline.source_alias, policy=policy, breaker=breaker, disk=disk)

    def close(self) -> None:
        """Drop the stored caches and release the executor (a ray executor's actors and placement group)."""
        self.cache.flush()  # what this run built is on disk for the next one
        self.cache.clear()
        self.cache.executor.close()

    @property
    def registry(self) -> ModelRegistry:
        return self.cache.executor.registry

    @property
    def mappings(self) -> MappingStore:
        return self.cache.mappings

    # -- public API -----------------------------------------------------------------------------
    async def run(self, document: str, *, on_event: EventSink | None = None, run_id: str | None = None,
                  inputs: Mapping[str, object] | None = None, resume: bool = False) -> RunReport:
        """Run every agent over `document` with the pipeline's `inputs` for this run (its declared names; defaults
        fill the rest); returns the report (also kept as `last_report`). RunInputError before anything runs
        when an input is missing or unknown.

        With a checkpointer, each finished agent is recorded under `run_id`; a `run_id` recorded before
        continues that run: agents that succeeded (or were degenerate) keep their results, the rest run.
        `resume=True` requires the run to exist. RunResumeError when it does not, or was another pipeline's,
        document's or inputs'.
        """
        from orchestra.inputs import resolve_inputs

        values = resolve_inputs(self.pipeline.inputs, inputs)
        if resume and (run_id is None or self.checkpointer is None):
            raise RunResumeError("resuming a run needs its run id and a checkpointer (orchestra run records one in "
                                 "<home>/runs.sqlite)")
        run_id = run_id or uuid.uuid4().hex[:12]
        from orchestra.tracing import run_tracer

        tracer = run_tracer()  # None unless OpenTelemetry is installed and a tracer provider is set

        async def emit(event: ev.Event) -> None:
            if tracer is not None:
                tracer(event)
            if event.kind != "token":  # tokens are in the stream; logging each would drown the log
                log.info(event.kind, **event.model_dump(exclude={"kind", "report"}))
            if on_event is not None:
                result = on_event(event)
                if result is not None:
                    await result

        report = await self._run(document, run_id, emit, values, self._resume_state(run_id, document, values, resume))
        self.last_report = report
        return report

    async def hold(self, document: str, *, input_tokens: int = HOLD_INPUT_TOKENS) -> list[CacheLease]:
        """Obtain the document's cache on the source and on every agent's member, as a run would, and keep
        them: until the leases are released (`unhold`) no budget evicts them, so runs over `document` meanwhile
        compute only their agents' own tokens (`Session` holds a document this way).

        A document that needs chunks is held chunk by chunk (on the source and every member a per-chunk agent
        runs on). The chunks are cut for inputs of up to `input_tokens` tokens each, and runs over the document
        keep that cut until `unhold`, so their chunks are the held ones whatever their inputs' lengths.
        """
        prefix_ids = await self._prefix_ids(document, check=False)

        async def quiet(event: ev.Event) -> None:
            return None

        run = _Run("hold", time.perf_counter(), prefix_ids, quiet, document=document,
                   inputs={name: "" for name in self.pipeline.inputs}, input_room=input_tokens)
        await self._plan_chunks(run)
        try:
            if run.chunks is None:
                await self._hold_whole(run)
            else:
                await self._hold_chunks(run)
        except BaseException:
            for _, lease in run.leases:
                lease.release()
            raise
        if run.chunks is not None:
            self._held_windows.setdefault(_held_key(document), []).append(run.window)
        return [lease for _, lease in run.leases]

    def unhold(self, document: str, leases: Sequence[CacheLease]) -> None:
        """Release what `hold` returned for `document` (its caches stay cached until the budget needs the room);
        once no hold of it is left, runs over it cut their chunks for their own inputs again."""
        for lease in leases:
            lease.release()
        windows = self._held_windows.get(_held_key(document))
        if windows:
            windows.pop()
            if not windows:
                del self._held_windows[_held_key(document)]

    def _held_readers(self, agents: Sequence[AgentNode]) -> dict[tuple[str, str], str]:
        """(member, repair) -> an agent reading that cache: one held cache per member and repair an agent asks for
        (the source's exact cache is held as the source's)."""
        readers: dict[tuple[str, str], str] = {}
        for agent in agents:
            repair = self._repair_for(agent.name)
            key = (agent.model, repair.model_dump_json() if repair is not None else "")
            if not (self.share_prefill and agent.model == self.source_alias):
                readers.setdefault(key, agent.name)
        return readers

    async def _hold_whole(self, run: _Run) -> None:
        if self.share_prefill:
            await self._acquire(run, None, self.source_alias)
        for (member, _), agent in self._held_readers(self.pipeline.agents).items():
            await self._acquire(run, agent, member, await self._prompt_for(run, agent, member))

    async def _hold_chunks(self, run: _Run) -> None:
        # a reduce agent reads its upstreams' notes, which change every run: only the chunk readers' caches last
        readers = self._held_readers([a for a in self.pipeline.agents
                                      if (a.per_chunk if a.per_chunk is not None else not a.upstream)])
        for part in run.chunks or []:
            i = part.chunk.index
            if self.share_prefill:
                await self._acquire(run, None, self.source_alias, _MemberPrompt(part.ids), chunk=i)
            for (member, _), agent in readers.items():
                await self._acquire(run, agent, member, await self._chunk_prompt(run, member, part), chunk=i)

    def _resume_state(self, run_id: str, document: str, inputs: dict[str, str], resume: bool) -> RunCheckpoint | None:
        """The checkpoint the run continues (recording its identity when it is new); None without a checkpointer."""
        if self.checkpointer is None:
            return None
        from orchestra.checkpoint import RunIdentity, document_digest, pipeline_digest

        identity = RunIdentity(pipeline=self.pipeline.name, pipeline_digest=pipeline_digest(self.pipeline.model_dump_json(exclude=_NOT_IN_RESULTS)),
                               document_digest=document_digest(document), inputs=inputs)
        state = self.checkpointer.resume_state(run_id, identity, must_exist=resume)
        self.checkpointer.begin(run_id, identity)
        return state

    async def stream(self, document: str, *, inputs: Mapping[str, object] | None = None, run_id: str | None = None,
                     resume: bool = False) -> AsyncIterator[ev.Event]:
        """Yield typed events as they happen; the last, `RunFinished`, carries this run's report."""
        send, receive = anyio.create_memory_object_stream[ev.Event](max_buffer_size=math.inf)
        failure: list[BaseException] = []

        async def runner() -> None:
            async with send:
                try:
                    await self.run(document, on_event=send.send, inputs=inputs, run_id=run_id, resume=resume)
                except Exception as exc:  # re-raised to the consumer after the stream drains
                    failure.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(runner)
            async with receive:
                async for event in receive:
                    yield event
        if failure:
            raise failure[0]

    # -- the run --------------------------------------------------------------------------------
    async def _prefix_ids(self, document: str, *, check: bool = True) -> list[int]:
        """The document prefix's token ids on the source, checked to leave every agent room for its reply."""
        from agents import DocumentPrompt
        from agents.errors import EmptyDocumentError

        tokenizer = await anyio.to_thread.run_sync(self.cache.executor.tokenizer, self.source_alias)
        try:
            prefix_ids = DocumentPrompt(document).token_ids(tokenizer)
        except EmptyDocumentError as exc:
            raise DocumentError(str(exc)) from exc
        if check:
            self._check_length(prefix_ids)
        return prefix_ids

    async def _run(self, document: str, run_id: str, emit, inputs: dict[str, str],
                   state: RunCheckpoint | None = None) -> RunReport:
        started = time.perf_counter()
        warned = len(self.cache.warnings)
        moved = self.cache.executor.stats()
        prefix_ids = await self._prefix_ids(document, check=False)
        run = _Run(run_id, started, prefix_ids, emit, document=document, inputs=inputs, checkpointer=self.checkpointer)
        await self._plan_chunks(run)
        if state is not None:
            from orchestra.checkpoint import RESTORABLE

            names = set(self.pipeline.upstreams())
            run.restored = {n: r for n, r in state.agents.items() if n in names and r.status in RESTORABLE}
            run.outputs.update({n: state.outputs[n] for n in run.restored if n in state.outputs})
        await emit(ev.RunStarted(run_id=run_id, agents=list(self.pipeline.upstreams()),
                                 source_model=self.source_alias, document_tokens=len(prefix_ids)))
        try:
            if self.share_prefill and run.chunks is not None:
                await self._prefill_chunks(run)
            elif self.share_prefill:
                lease = await self._acquire(run, None, self.source_alias)
                await emit(ev.DocumentPrefilled(run_id=run_id, model=self.source_alias, tokens=len(prefix_ids),
                                                seconds=lease.prefill_seconds, store_hit=lease.hit))
            done = {name: anyio.Event() for name in self.pipeline.upstreams()}
            async with anyio.create_task_group() as tg:
                for agent in self.pipeline.agents:
                    tg.start_soon(self._agent_task, run, agent.name, done)
                for step in self.pipeline.steps:
                    tg.start_soon(self._step_task, run, step, done)
        finally:
            for _, lease in run.leases:
                lease.release()
        report = await self._report(run, started, warned, moved)
        if run.checkpointer is not None:
            await anyio.to_thread.run_sync(run.checkpointer.finish, run.run_id)
        return report

    async def _report(self, run: _Run, started: float, warned: int, moved: dict[str, int] | None = None) -> RunReport:
        reports = [run.reports[name] for name in self.pipeline.upstreams()]
        seconds = time.perf_counter() - started
        builders: dict[int, CacheLease] = {}

        def work(lease: CacheLease) -> tuple[float, bool]:  # the lease that built an entry, not one that joined it
            return lease.prefill_seconds + lease.map_seconds, not lease.hit

        for _, lease in run.leases:
            key = lease.entry_id or id(lease)  # aliases of one model share entries: one cache, reported once
            if key not in builders or work(lease) > work(builders[key]):
                builders[key] = lease
        caches = [
            ModelCacheReport(model=lease.member, path=lease.path, seconds=lease.prefill_seconds + lease.map_seconds,
                             store_hit=lease.hit, mapping=lease.mapping, tail_tokens=lease.tail_tokens,
                             repair=lease.repair, from_disk=lease.loaded_tokens > 0, disk_load_s=lease.load_seconds,
                             disk_tokens=lease.loaded_tokens)
            for lease in builders.values()
        ]
        spent = sum(lease.prefill_seconds + lease.map_seconds for _, lease in run.leases)
        hits = sum(1 for _, lease in run.leases if lease.hit)
        total = len(run.leases)
        report = RunReport(
            run_id=run.run_id, pipeline=self.pipeline.name, source_model=self.source_alias,
            document_tokens=len(run.prefix_ids), agents=reports, caches=caches, seconds=seconds,
            prefill_s_spent=spent, prefill_s_saved=sum(r.prefill_s_saved for r in reports),
            store_hits=hits, store_misses=total - hits, store_hit_rate=hits / total if total else 0.0,
            disk_loads=sum(1 for _, lease in run.leases if lease.loaded_tokens),
            disk_load_s=sum(lease.load_seconds for _, lease in run.leases),
            warnings=self.cache.warnings[warned:], executor=self.cache.executor.kind, inputs=run.inputs,
            restored=list(run.restored), chunks=_chunk_summaries(run), prefill_s_every_chunk=run.every_chunk_s,
            **{key: value - (moved or {}).get(key, 0) for key, value in self.cache.executor.stats().items()
               if key in _MOVED},
        )
        await run.emit(ev.RunFinished(
            run_id=run.run_id, succeeded=[r.name for r in reports if r.status == "succeeded"],
            failed=[r.name for r in reports if r.status == "failed"],
            skipped=[r.name for r in reports if r.status == "skipped"], seconds=seconds,
            degenerate=[r.name for r in reports if r.status == "degenerate"], report=report,
        ))
        return report

    def _check_length(self, prefix_ids: list[int], agents: list[str] | None = None) -> None:
        """Refuse a prefix that leaves `agents` (default: all) no room for their new tokens."""
        for agent in self.pipeline.agents:
            if agents is not None and agent.name not in agents:
                continue
            info = self.cache.info(agent.model)
            need = len(prefix_ids) + self.specs[agent.name].generation.max_new_tokens + 1
            if info.max_positions and need > info.max_positions:
                limit, new = info.max_positions, self.specs[agent.name].generation.max_new_tokens
                over, room = need - limit, limit - len(prefix_ids) - 1  # room: new tokens that fit after the document
                if new + 1 >= limit:  # the generation bound alone does not fit: shortening cannot help
                    fix = (f"lower the agent's max_new_tokens to at most {room}" if room >= 1 else
                           f"lower the agent's max_new_tokens and shorten the document to under {limit} tokens")
                elif room < 1:  # the document alone does not fit
                    fix = f"shorten the document by {over} tokens or more"
                else:
                    fix = f"lower the agent's max_new_tokens to at most {room}, or shorten the document by {over} tokens"
                raise DocumentError(
                    f"the document is {len(prefix_ids)} tokens; with agent {agent.name!r}'s {new} new tokens it "
                    f"needs {need} positions but model {agent.model!r} takes at most {limit}: {fix}"
                )

    async def _acquire(self, run: _Run, agent: str | None, member: str,
                       prompt: _MemberPrompt | None = None, *, chunk: int | None = None,
                       mapped: bool = True) -> CacheLease:
        """The document's (or a chunk's) cache on `member` from the FamilyCache, its steps re-emitted live as run
        events; `mapped` False: never mapped from the source (a reduce agent's notes exist on no other member)."""
        node = self.pipeline.agent(agent) if agent is not None else None
        gate = (node.gate if node is not None else None) or self.pipeline.gate

        def on_step(step: CacheStep) -> None:  # in the FamilyCache's worker thread
            anyio.from_thread.run(run.emit, _step_event(run.run_id, agent, step, chunk))

        prompt = prompt or _MemberPrompt(run.prefix_ids)
        repair = self._repair_for(agent) if agent is not None else None
        # a member whose prefix has other ids prefills it itself: the source's cache (or a map of the
        # source's prefill of these ids, which costs the same prefill again) cannot serve it better
        lease = await self.cache.acquire(member, prompt.ids, gate=gate, repair=repair, on_step=on_step,
                                         allow_mapped=self.share_prefill and prompt.own_reason is None and mapped,
                                         reuse=self.share_prefill)
        run.leases.append((agent, lease))
        return lease

    def _repair_for(self, agent: str) -> RepairPolicy | None:
        """How a mapped cache `agent` reads is repaired: its node's, else its spec's (None: the cache's policy)."""
        node = self.pipeline.agent(agent)
        return node.repair if node.repair is not None else self.specs[agent].mapped_repair

    async def _prompt_for(self, run: _Run, agent: str, member: str) -> _MemberPrompt:
        """The document prefix as `member`'s own tokenizer and chat template lay it out (once per member and run).

        Members share token ids (`ModelRegistry.check_family`), not necessarily a chat template: another
        template, or another BOS framing, gives the prefix other ids. The agent's suffix is laid out by the
        member's template, so its prefix must be too; its cache then cannot come from the source's.
        """
        if member == self.source_alias:
            return _MemberPrompt(run.prefix_ids)
        if member not in run.prompts:
            run.prompts[member] = await anyio.to_thread.run_sync(self._member_prompt, run.document,
                                                                 run.prefix_ids, member)
        prompt = run.prompts[member]
        if len(prompt.ids) != len(run.prefix_ids):
            self._check_length(prompt.ids, [agent])
        return prompt

    def _member_prompt(self, document: str, source_ids: list[int], member: str) -> _MemberPrompt:
        """`member`'s prefix ids (blocking: loads its tokenizer); the source's own list when they are the same."""
        from agents import DocumentPrompt
        from mappings.tokenizer_compat import first_difference

        tokenizer = self.cache.executor.tokenizer(member)
        ids = DocumentPrompt(document).token_ids(tokenizer)
        first = first_difference(ids, source_ids)
        if first is None:
            return _MemberPrompt(source_ids)
        source = self.cache.executor.tokenizer(self.source_alias)
        if self.cache.info(member).tokenizer_digest != self.cache.info(self.source_alias).tokenizer_digest:
            what = "tokenizer (another vocabulary or other merges)"
        elif getattr(tokenizer, "chat_template", None) != getattr(source, "chat_template", None):
            what = "chat template"
        else:
            what = "special-token framing (a leading BOS)"
        reason = (f"the member's {what} tokenizes the document prefix differently from the source's (first "
                  f"difference at token {first}): it cannot reuse the source's cache and prefilled the document itself")
        return _MemberPrompt(ids, reason)

    # -- chunked runs ---------------------------------------------------------------------------
    async def _plan_chunks(self, run: _Run) -> None:
        """Cut the document into chunks when the pipeline's chunking says so (auto: only when it does not fit);
        else check it fits, refusing it as always (mode never, or a document that fits)."""
        policy = self.pipeline.chunking
        refused: DocumentError | None = None
        if policy.mode != "always":
            try:
                self._check_length(run.prefix_ids)
                return
            except DocumentError as exc:
                if policy.mode == "never":
                    raise
                refused = exc
        self._check_chunk_agents()
        room = await anyio.to_thread.run_sync(self._default_window, run)
        held = self._held_windows.get(_held_key(run.document))
        window = policy.window_tokens or (min(held) if held else None) or room
        if window is None:
            raise DocumentError("chunking.mode is always but no model bounds its context: set chunking.window_tokens")
        if room is not None and window > room:
            if held and not policy.window_tokens:
                raise DocumentError(f"the document is held (a session) in chunks of {window} tokens, but this run's "
                                    f"inputs leave room for chunks of at most {room}: shorten the inputs, or hold "
                                    "the document for longer ones (pipeline.session(..., input_tokens=...))")
            raise DocumentError(f"chunking.window_tokens is {window}, but the agents' prompts and replies leave room "
                                f"for chunks of at most {room} tokens: lower it to {room} or less, or unset it")
        from orchestra.chunking import prefix_tokens, split_document

        tokenizer = await anyio.to_thread.run_sync(self.cache.executor.tokenizer, self.source_alias)
        try:
            chunks = await anyio.to_thread.run_sync(functools.partial(
                split_document, run.document, tokenizer, window, policy.overlap_tokens))
        except DocumentError as exc:
            raise DocumentError(f"{refused}; chunking cannot help: {exc}" if refused else str(exc)) from exc

        def layout() -> list[Part]:
            return [Part(c, c.label(len(chunks)), prefix_tokens(c.text, tokenizer), self.source_alias) for c in chunks]

        run.chunks, run.window = await anyio.to_thread.run_sync(layout), window
        widest = max(run.chunks, key=lambda part: len(part.ids))
        try:
            self._check_length(widest.ids)
        except DocumentError as exc:
            raise DocumentError(f"{exc} (a chunk of {window} tokens): lower chunking.window_tokens") from exc

    def _check_chunk_agents(self) -> None:
        for agent in self.pipeline.agents:
            if agent.per_chunk is False and not agent.upstream:
                raise DocumentError(f"agent {agent.name!r} has per_chunk: false and no upstream agents, so a chunked "
                                    "run gives it nothing to read: set per_chunk: true (or chunking.mode: never)")

    def _default_window(self, run: _Run) -> int | None:
        """Prefix tokens every agent has room for after its suffix and new tokens (blocking: loads tokenizers)."""
        from agents.prompt import build_suffix

        limits = []
        for agent in self.pipeline.agents:
            info = self.cache.info(agent.model)
            if not info.max_positions:
                continue
            spec = self.specs[agent.name]
            values = {**{n: run.inputs[n] for n in self.pipeline.input_reads(agent.name)},
                      **{up: pointer(up) for up in agent.upstream}}
            suffix = build_suffix(self.cache.executor.tokenizer(agent.model), spec, values)
            kept = run.input_room * len(self.pipeline.input_reads(agent.name))
            limits.append(info.max_positions - len(suffix.ids) - spec.generation.max_new_tokens - 1 - _WINDOW_MARGIN
                          - kept)
        return min(limits) if limits else None

    async def _prefill_chunks(self, run: _Run) -> None:
        """Each chunk prefilled once on the source, before any agent reads it (others map from it)."""
        for part in run.chunks or []:
            i = part.chunk.index
            lease = await self._acquire(run, None, self.source_alias, _MemberPrompt(part.ids), chunk=i)
            run.source_prefill[i] = lease.prefill_seconds
            run.chunk_paths.setdefault(i, {})[self.source_alias] = lease.path
            await run.emit(ev.DocumentPrefilled(run_id=run.run_id, model=self.source_alias, tokens=len(part.ids),
                                                seconds=lease.prefill_seconds, store_hit=lease.hit, chunk=i))

    async def _chunk_prompt(self, run: _Run, member: str, part: Part) -> _MemberPrompt:
        """The part's prefix as `member` lays it out (once per member, round and chunk)."""
        if member == part.member:
            return _MemberPrompt(part.ids)
        key = (member, part.round, part.chunk.index)
        if key not in run.chunk_prompts:
            run.chunk_prompts[key] = await anyio.to_thread.run_sync(self._member_prompt, part.chunk.text, part.ids,
                                                                    member)
        return run.chunk_prompts[key]

    async def _chunked_agent(self, run: _Run, name: str, report: AgentReport, on_token: TokenSink,
                             scope: contextlib.AbstractContextManager[object]) -> Combined:
        """A per-chunk agent over its chunks (map), or a reduce agent over its upstreams' combined outputs; all of
        its calls within `scope` (the agent's timeout)."""
        with scope:
            return await self._chunked_calls(run, name, report, on_token)

    async def _chunked_calls(self, run: _Run, name: str, report: AgentReport, on_token: TokenSink) -> Combined:
        agent = self.pipeline.agent(name)
        inputs = {n: run.inputs[n] for n in self.pipeline.input_reads(name)}
        per_chunk = agent.per_chunk if agent.per_chunk is not None else not agent.upstream
        if not per_chunk:
            return await self._reduce(run, name, report, inputs, on_token)
        upstream = {**inputs, **{up: run.outputs.get(up) or _unavailable(up, report.missing_upstreams)
                                 for up in agent.upstream}}
        parts = run.chunks or []
        if agent.chunks != "all":
            from orchestra.chunking import select_chunks

            chosen = select_chunks([p.chunk.text for p in parts], _retrieval_query(agent, self.specs[name], upstream),
                                   int(agent.chunks))
            parts = [parts[i] for i in chosen]
        results = await self._map(run, name, report, parts, upstream, on_token)
        return combine(self.specs[name].output.kind == "json", results)

    async def _reduce(self, run: _Run, name: str, report: AgentReport, inputs: dict[str, str],
                      on_token: TokenSink) -> Combined:
        """The agent over its upstreams' outputs as its document; notes longer than a window reduce in rounds
        (the agent over each chunk of them, joined, again) until one call reads them all."""
        from orchestra.chunking import prefix_tokens, split_document

        agent = self.pipeline.agent(name)
        upstream = {**inputs, **{up: pointer(up) for up in agent.upstream}}
        notes = notes_document({up: run.outputs.get(up) or _unavailable(up, report.missing_upstreams)
                                for up in agent.upstream})
        tokenizer = await anyio.to_thread.run_sync(self.cache.executor.tokenizer, agent.model)
        json_output = self.specs[name].output.kind == "json"
        for round_ in range(1, _MAX_ROUNDS + 1):
            chunks = await anyio.to_thread.run_sync(functools.partial(
                split_document, notes, tokenizer, run.window, self.pipeline.chunking.overlap_tokens))
            parts = [Part(c, round_label(c, len(chunks), round_),
                          await anyio.to_thread.run_sync(prefix_tokens, c.text, tokenizer), agent.model, round_)
                     for c in chunks]
            combined = combine(json_output, await self._map(run, name, report, parts, upstream, on_token))
            if len(parts) == 1 or combined.degenerate is not None:
                return combined
            if len(combined.downstream) >= len(notes):
                raise DocumentError(f"agent {name!r}: reduce round {round_} did not shorten its notes ({len(notes)} "
                                    "characters): lower its max_new_tokens or raise chunking.window_tokens")
            notes = combined.downstream
        raise DocumentError(f"agent {name!r}: its notes still span several windows after {_MAX_ROUNDS} reduce "
                            "rounds: lower its upstreams' max_new_tokens or raise chunking.window_tokens")

    async def _map(self, run: _Run, name: str, report: AgentReport, parts: list[Part], upstream: dict[str, str],
                   on_token: TokenSink) -> list[tuple[Part, AgentResult]]:
        """One call per part, up to `chunking.parallel_calls` at once (default: as many as the executor can run
        on the member); results, and the report's calls, in the parts' order whatever order they finish in."""
        agent = self.pipeline.agent(name)
        limit = self.pipeline.chunking.parallel_calls or self.cache.executor.parallelism(agent.model)
        results: list[AgentResult | None] = [None] * len(parts)
        limiter = anyio.CapacityLimiter(max(1, limit))

        failed: list[Exception] = []

        async def call(i: int, tg: anyio.abc.TaskGroup) -> None:
            async with limiter:
                try:
                    results[i] = await self._chunk_call(run, name, report, parts[i], upstream, on_token)
                except Exception as exc:  # the first failed call is the agent's error, as when calls run in turn
                    failed.append(exc)
                    tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(parts)):
                    tg.start_soon(call, i, tg)
        finally:
            report.chunks.sort(key=lambda c: (c.round, c.index))
        if failed:
            raise failed[0]
        return [(part, result) for part, result in zip(parts, results, strict=True) if result is not None]

    async def _chunk_call(self, run: _Run, name: str, report: AgentReport, part: Part, upstream: dict[str, str],
                          on_token: TokenSink) -> AgentResult:
        """One call over one part's prefix, its cache acquired like a whole document's; recorded in the report."""
        agent = self.pipeline.agent(name)
        chunk = part.chunk.index if part.round == 0 else None
        prompt = await self._chunk_prompt(run, agent.model, part)
        lease = await self._acquire(run, name, agent.model, prompt, chunk=chunk, mapped=part.round == 0)
        scratch = AgentReport(name=name, model=agent.model, status="failed")
        self._record_cache(run, scratch, lease)
        if prompt.own_reason is not None and self.share_prefill and scratch.fallback_reason is None:
            scratch.cache_path, scratch.fallback_reason = "reprefilled", prompt.own_reason
        await run.emit(ev.CacheReady(run_id=run.run_id, model=agent.model, agent=name,
                                     path=scratch.cache_path or lease.path,
                                     seconds=lease.seconds, store_hit=lease.hit, repair=lease.repair, chunk=chunk))
        where: dict[str, str] = {}
        try:
            result = await self.cache.executor.generate(agent.model, self.specs[name], prefix_ids=prompt.ids,
                                                        prefix_cache=lease.cache, upstream=upstream,
                                                        on_token=functools.partial(on_token, chunk=chunk),
                                                        placement=where)
        except Exception as exc:
            raise ChunkCallError(f"agent {name!r} failed on {part.label}: {type(exc).__name__}: {exc}") from exc
        finally:
            report.actor, report.node = where.get("actor"), where.get("node")
        estimate = self.cache.prefill_estimate(agent.model, len(prompt.ids))
        run.every_chunk_s += estimate
        if chunk is not None and scratch.cache_path is not None:
            run.chunk_paths.setdefault(chunk, {})[agent.model] = scratch.cache_path
        report.chunks.append(ChunkCall(
            index=part.chunk.index, label=part.label, round=part.round, cache_path=scratch.cache_path,
            prefix_tokens=len(prompt.ids), tokens=result.generated_tokens, prefill_s_spent=scratch.prefill_s_spent,
            prefill_s_saved=max(0.0, estimate - scratch.prefill_s_spent) if self.share_prefill else 0.0,
            degenerate_reason=str(result.degenerate) if result.degenerate is not None else None))
        report.gate += scratch.gate
        report.fallback_reason = report.fallback_reason or scratch.fallback_reason
        report.generation_s = (report.generation_s or 0.0) + result.timings.generation_s
        report.suffix_tokens = max(report.suffix_tokens, result.suffix_tokens)
        report.attempts, report.constrained = max(report.attempts, result.attempts), report.constrained or result.constrained
        report.duplicates_removed += result.duplicates_removed
        return result

    async def _finish_chunked(self, run: _Run, report: AgentReport, combined: Combined,
                              first_token: list[float]) -> None:
        """A chunked agent's report and output from its calls; degenerate only when every call was."""
        calls = report.chunks
        report.ttft_s = (first_token[0] - run.started) if first_token else None
        report.output, report.parsed = combined.text, combined.parsed
        report.tokens = sum(c.tokens for c in calls)
        report.prefill_s_spent = sum(c.prefill_s_spent for c in calls)
        report.prefill_s_saved = sum(c.prefill_s_saved for c in calls)
        paths = [c.cache_path for c in calls if c.cache_path is not None]
        report.cache_path = max(paths, key=_PATH_ORDER.index) if paths else None  # the costliest path it took
        report.duplicates_removed += combined.duplicates_removed
        if combined.degenerate is not None:
            report.status, report.degenerate_reason = "degenerate", combined.degenerate
            await self._checkpoint(run, report)
            await run.emit(ev.AgentDegenerate(run_id=run.run_id, agent=report.name, reason=combined.degenerate,
                                              output=combined.text))
            return
        run.outputs[report.name] = combined.downstream
        report.status = "succeeded"
        await self._checkpoint(run, report)
        await run.emit(ev.AgentFinished(run_id=run.run_id, agent=report.name, output=combined.text,
                                        parsed=report.parsed))

    async def _agent_task(self, run: _Run, name: str, done: dict[str, anyio.Event]) -> None:
        agent = self.pipeline.agent(name)
        if await self._restored(run, name, done):
            return
        report = AgentReport(name=name, model=agent.model, status="failed")
        run.reports[name] = report
        try:
            if await self._wait_or_skip(run, report, agent.upstream, agent.on_upstream_failure, agent.condition, done):
                return
            await run.emit(ev.AgentStarted(run_id=run.run_id, agent=name, model=agent.model))
            first_token: list[float] = []
            on_token = _token_sink(run, name, first_token)

            scope = anyio.fail_after(agent.timeout_s) if agent.timeout_s else contextlib.nullcontext()
            if run.chunks is not None:
                await self._finish_chunked(run, report, await self._chunked_agent(run, name, report, on_token, scope),
                                           first_token)
                return
            with scope:
                prompt = await self._prompt_for(run, name, agent.model)
                lease = await self._acquire(run, name, agent.model, prompt)
                self._record_cache(run, report, lease)
                if prompt.own_reason is not None and self.share_prefill and report.fallback_reason is None:
                    report.cache_path, report.fallback_reason = "reprefilled", prompt.own_reason
                    await run.emit(ev.Fallback(run_id=run.run_id, agent=name, model=agent.model,
                                               reason=prompt.own_reason))
                await run.emit(ev.CacheReady(run_id=run.run_id, model=agent.model, agent=name,
                                             path=report.cache_path or lease.path, seconds=lease.seconds,
                                             store_hit=lease.hit, repair=lease.repair))
                where: dict[str, str] = {}
                try:
                    result = await self.cache.executor.generate(
                        agent.model, self.specs[name], prefix_ids=prompt.ids, prefix_cache=lease.cache,
                        upstream={**{n: run.inputs[n] for n in self.pipeline.input_reads(name)},
                                  **{up: run.outputs.get(up) or _unavailable(up, report.missing_upstreams)
                                     for up in agent.upstream}},
                        on_token=on_token, placement=where,
                    )
                finally:
                    report.actor, report.node = where.get("actor"), where.get("node")
            report.output = result.text
            report.parsed = _jsonable(result.parsed)
            report.attempts = result.attempts
            report.constrained = result.constrained
            report.grounding = _jsonable(result.grounding)
            report.duplicates_removed = result.duplicates_removed
            report.tool_calls = [call.as_dict() for call in result.tool_calls]
            await self._emit_tool_calls(run, name, result)
            report.tokens = result.generated_tokens
            report.suffix_tokens = result.suffix_tokens
            report.generation_s = result.timings.generation_s
            report.ttft_s = (first_token[0] - run.started) if first_token else None
            estimate = self.cache.prefill_estimate(agent.model, len(prompt.ids))
            report.prefill_s_saved = max(0.0, estimate - report.prefill_s_spent) if self.share_prefill else 0.0
            if result.degenerate is not None:
                # never handed downstream as an answer: dependants are skipped, naming this agent and why
                report.status = "degenerate"
                report.degenerate_reason = str(result.degenerate)
                await self._checkpoint(run, report)
                await run.emit(ev.AgentDegenerate(run_id=run.run_id, agent=name, reason=report.degenerate_reason,
                                                  output=result.text))
                return
            run.outputs[name] = result.downstream_text()
            report.status = "succeeded"
            await self._checkpoint(run, report)
            await run.emit(ev.AgentFinished(run_id=run.run_id, agent=name, output=result.text,
                                            parsed=report.parsed))
        except Exception as exc:
            report.status = "failed"
            report.error_type = type(exc).__name__
            report.error = str(exc) or (f"timed out after {agent.timeout_s}s" if isinstance(exc, TimeoutError) else "")
            await self._checkpoint(run, report)
            await run.emit(ev.AgentFailed(run_id=run.run_id, agent=name, error_type=report.error_type,
                                          error=report.error))
        finally:
            done[name].set()

    @staticmethod
    async def _emit_tool_calls(run: _Run, name: str, result: AgentResult) -> None:
        for call in result.tool_calls:
            await run.emit(ev.ToolCallEvent(run_id=run.run_id, agent=name, tool=call.name,
                                            arguments=call.arguments, round=call.round))
            await run.emit(ev.ToolResultEvent(run_id=run.run_id, agent=name, tool=call.name, result=call.result,
                                              ok=call.ok, seconds=call.seconds, round=call.round))

    async def _restored(self, run: _Run, name: str, done: dict[str, anyio.Event]) -> bool:
        """Keep a node's result from the run's checkpoint (a resumed run); True when it was kept."""
        if name not in run.restored:
            return False
        kept = run.reports[name] = run.restored[name]
        try:
            await run.emit(ev.AgentRestored(run_id=run.run_id, agent=name, status=kept.status, output=kept.output))
        finally:
            done[name].set()
        return True

    async def _wait_or_skip(self, run: _Run, report: AgentReport, upstream: list[str], on_failure: str,
                            condition: WhenLike | None, done: dict[str, anyio.Event]) -> bool:
        """Wait for the node's upstreams; skip it (True) when one it needs gave nothing or its condition is false."""
        for up in upstream:
            await done[up].wait()
        bad = [up for up in upstream if run.reports[up].status != "succeeded"]
        if bad and on_failure == "run_with_available" and len(bad) < len(upstream):
            report.missing_upstreams = {up: _skip_reason([run.reports[up]]) for up in bad}
            bad = []
        return await self._skipped(run, report, upstream, bad, condition)

    async def _skipped(self, run: _Run, report: AgentReport, upstream: list[str], bad: list[str],
                       condition: WhenLike | None) -> bool:
        """Skip the node (reported, recorded, announced) when an upstream it needs gave nothing or its condition is
        false; True when it was skipped."""
        if bad:
            report.skip_reason = _skip_reason([run.reports[up] for up in bad])
        else:
            holds, what = condition_holds(condition, {up: run.outputs.get(up, "") for up in upstream})
            if holds:
                return False
            report.skip_reason = f"its condition is false: {what}"
        report.status = "skipped"
        await self._checkpoint(run, report)
        await run.emit(ev.AgentSkipped(run_id=run.run_id, agent=report.name, reason=report.skip_reason))
        return True

    async def _step_task(self, run: _Run, step: StepNode, done: dict[str, anyio.Event]) -> None:
        """A Python step: after its upstreams (skipped like an agent when one gave nothing or its condition is
        false), its function runs; its output is read downstream; an exception fails it alone."""
        name = step.name
        if await self._restored(run, name, done):
            return
        report = AgentReport(name=name, model="step", status="failed")
        run.reports[name] = report
        try:
            if await self._wait_or_skip(run, report, step.upstream, step.on_upstream_failure, step.condition, done):
                return
            await run.emit(ev.AgentStarted(run_id=run.run_id, agent=name, model="step"))
            t0 = time.perf_counter()
            scope = anyio.fail_after(step.timeout_s) if step.timeout_s else contextlib.nullcontext()
            with scope:
                output = await call_step(step, run.document,
                                         {up: run.outputs[up] for up in step.upstream if up in run.outputs}, run.inputs)
            report.generation_s = time.perf_counter() - t0
            report.output = output
            run.outputs[name] = output
            report.status = "succeeded"
            await self._checkpoint(run, report)
            await run.emit(ev.AgentFinished(run_id=run.run_id, agent=name, output=output))
        except Exception as exc:
            report.status = "failed"
            report.error_type = type(exc).__name__
            report.error = str(exc) or (f"timed out after {step.timeout_s}s" if isinstance(exc, TimeoutError) else "")
            await self._checkpoint(run, report)
            await run.emit(ev.AgentFailed(run_id=run.run_id, agent=name, error_type=report.error_type,
                                          error=report.error))
        finally:
            done[name].set()

    async def _checkpoint(self, run: _Run, report: AgentReport) -> None:
        """Record a finished agent before anyone hears of it (a run killed after the event has it on record)."""
        if run.checkpointer is not None:
            await anyio.to_thread.run_sync(run.checkpointer.record, run.run_id, report, run.outputs.get(report.name))

    def _record_cache(self, run: _Run, report: AgentReport, lease: CacheLease) -> None:
        """The agent's cache path, gate decisions and prefill seconds (a shared cache is charged once)."""
        report.cache_path = lease.path
        report.gate = lease.gate_dicts()
        report.fallback_reason = lease.fallback_reason
        spent = lease.prefill_seconds if lease.path != "mapped" else 0.0
        if lease.hit and lease.entry_id not in run.charged:
            # the run's own source prefill built this entry: the first agent reading it pays for it
            spent = next((src.prefill_seconds for who, src in run.leases if who is None
                          and src.entry_id == lease.entry_id), 0.0)
        run.charged.add(lease.entry_id)
        report.prefill_s_spent = spent


_PATH_ORDER = ("exact", "mapped", "reprefilled")
_WINDOW_MARGIN = 16
"""Tokens a default chunk window leaves spare (a suffix laid out with other upstream text may be longer)."""
_MAX_ROUNDS = 8
"""Reduce rounds before a reduce that does not converge is given up."""

_MOVED = ("kv_bytes_moved", "kv_bytes_moved_across_nodes", "result_bytes_to_driver")
"""Executor counters the run report carries (what this run moved between processes)."""


def _retrieval_query(agent: AgentNode, spec: AgentSpec, values: Mapping[str, object]) -> str:
    """What `chunks: k` ranks the chunks against: the node's `query`, a question_answerer's question, else its task.

    A built-in's task wraps the question in instructions ("answer ... from the document above"), and their words
    would pull the chunks that say "document" most (a licence for documentation, say) above the one that answers.
    """
    if agent.query is not None:
        return type(spec)(name=spec.name, task=agent.query).render_task(values)
    question = agent.args.get("question") if agent.builtin == "question_answerer" else None
    if isinstance(question, str):  # the built-in takes its question literally (never as a template)
        return question
    return spec.render_task(values)


def _step_event(run_id: str, agent: str | None, step: CacheStep, chunk: int | None = None) -> ev.Event:
    """Gate and fallback steps keep their own event kinds; every other step is a `cache_step` event."""
    if step.step in ("gate", "shadow") and agent is not None:
        return ev.GateResult(run_id=run_id, agent=agent, model=step.member, passed=bool(step.passed),
                             reason=step.reason or "", metrics=step.metrics, chunk=chunk)
    if step.step == "fallback" and agent is not None:
        return ev.Fallback(run_id=run_id, agent=agent, model=step.member, reason=step.reason or "", chunk=chunk)
    return ev.CacheStepEvent(run_id=run_id, agent=agent, step=step, chunk=chunk)


def _token_sink(run: _Run, name: str, first_token: list[float]) -> TokenSink:
    """The agent's token events (with the chunk its call reads, in chunked runs); notes when the first came."""

    async def on_token(token: Any, chunk: int | None = None) -> None:
        if not first_token:
            first_token.append(time.perf_counter())
        await run.emit(ev.TokenEvent(run_id=run.run_id, agent=name, text=token.text, index=token.index, chunk=chunk))

    return on_token


def _chunk_summaries(run: _Run) -> list[ChunkSummary]:
    return [ChunkSummary(index=p.chunk.index, label=p.label, anchor=p.chunk.anchor, start=p.chunk.start,
                         end=p.chunk.end, tokens=len(p.ids), paths=run.chunk_paths.get(p.chunk.index, {}),
                         source_prefill_s=run.source_prefill.get(p.chunk.index, 0.0)) for p in run.chunks or []]


def _unavailable(upstream: str, missing: dict[str, str]) -> str:
    """What an agent run on the upstreams it has reads in place of one that gave nothing."""
    return f"(not available: {missing.get(upstream, 'upstream ' + upstream + ' gave no output')})"


def _skip_reason(bad: list[AgentReport]) -> str:
    """Why a downstream agent is skipped, naming each upstream whose output it cannot use."""
    failed = [up.name for up in bad if up.status != "degenerate"]
    parts = [f"upstream {', '.join(failed)} did not succeed"] if failed else []
    parts += [f"upstream {up.name} produced degenerate output ({up.degenerate_reason})"
              for up in bad if up.status == "degenerate"]
    return "; ".join(parts)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def _default_family() -> FamilyManifest | None:
    from orchestra.family.manifest import load_family

    try:
        return load_family()
    except Exception:
        return None
