"""Run a pipeline's DAG over one document; every cache comes from the FamilyCache.

Each agent starts as soon as its own upstreams are done (no supersteps: a slow sibling never holds
back a fast branch). The scheduler prefills nothing, maps nothing and gates nothing itself: it asks
the FamilyCache for the document's cache on the agent's member, re-emits what the cache did as
run events, runs the agent over a private copy, and adds up the report. Each member's prefix is laid out
by its own tokenizer and chat template; a member whose prefix ids differ from the source's (another chat
template) cannot share the source's cache: it prefills its own, and its agents report why as a fallback.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.from_thread

from agents.bridge import in_thread
from orchestra._logging import get_logger
from orchestra.documents.chunking import HOLD_INPUT_TOKENS
from orchestra.errors import DocumentError, RunResumeError
from orchestra.familycache import CacheLease, CachePolicy, FamilyCache, make_executor
from orchestra.familycache.gates import CircuitBreaker
from orchestra.familycache.mapping_store import MappingStore
from orchestra.models.registry import ModelRegistry
from orchestra.observability import events as ev
from orchestra.observability.report import RunReport
from orchestra.paths import resolve_home
from orchestra.pipelines.graph import build_graph
from orchestra.pipelines.spec import AgentNode, PipelineSpec
from orchestra.runs._chunked import ChunkedRuns, held_key
from orchestra.runs._state import (
    EventSink,
    MemberPrompt,
    RunState,
    cache_reports,
    chunk_summaries,
    finished_event,
    step_sink,
)
from orchestra.runs._walk import DagWalk

if TYPE_CHECKING:
    from agents.runner import AgentResult
    from mappings.repair import RepairPolicy
    from orchestra.family.manifest import FamilyManifest
    from orchestra.familycache.gates import AnswerGate, GateDecision, GatePolicy
    from orchestra.runs.checkpoint import Checkpointer, RunCheckpoint

__all__ = ["Orchestra"]

log = get_logger("orchestra")


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
        self.walk = DagWalk(self)
        """The DAG walk: each node a task of its own, started when its upstreams are done."""
        self.chunked = ChunkedRuns(self)
        """Chunked runs: documents longer than a window, map-reduced over chunks prefilled once."""

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
        executor.use_gate(pipeline.gate)
        disk = None
        settings = pipeline.kv_store
        env = os.environ.get(KV_STORE_ENV, "")
        off = env.lower() == "off"
        folder = Path(env) if env and not off else home / "kv" if home is not None else None
        directory = Path(settings.directory) if settings.directory else folder
        wanted = settings.enabled if settings.enabled is not None else bool(settings.directory) or not off
        if wanted and directory is not None:
            from orchestra.familycache import KVStore

            # a run's caches are its documents, which a later run of the same document needs whole: one is
            # skipped only when a stored entry already holds every token of it (the default skips near-duplicate
            # chat prompts, and a document whose beginning a longer entry holds was recomputed in part each run)
            disk = KVStore(directory, settings.budget_mb << 20, min_new_tokens=0)
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
        from orchestra.pipelines.inputs import resolve_inputs

        values = resolve_inputs(self.pipeline.inputs, inputs)
        if resume and (run_id is None or self.checkpointer is None):
            raise RunResumeError("resuming a run needs its run id and a checkpointer (orchestra run records one in "
                                 "<home>/runs.sqlite)")
        run_id = run_id or uuid.uuid4().hex[:12]
        from orchestra.observability.tracing import run_tracer

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

        run = RunState("hold", time.perf_counter(), prefix_ids, quiet, document=document,
                   inputs={name: "" for name in self.pipeline.inputs}, input_room=input_tokens)
        await self.chunked.plan(run)
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
            self._held_windows.setdefault(held_key(document), []).append(run.window)
        return [lease for _, lease in run.leases]

    def unhold(self, document: str, leases: Sequence[CacheLease]) -> None:
        """Release what `hold` returned for `document` (its caches stay cached until the budget needs the room);
        once no hold of it is left, runs over it cut their chunks for their own inputs again."""
        for lease in leases:
            lease.release()
        windows = self._held_windows.get(held_key(document))
        if windows:
            windows.pop()
            if not windows:
                del self._held_windows[held_key(document)]

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

    async def _hold_whole(self, run: RunState) -> None:
        if self.share_prefill:
            await self._acquire(run, None, self.source_alias)
        for (member, _), agent in self._held_readers(self.pipeline.agents).items():
            await self._acquire(run, agent, member, await self._prompt_for(run, agent, member))

    async def _hold_chunks(self, run: RunState) -> None:
        # a reduce agent reads its upstreams' notes, which change every run: only the chunk readers' caches last
        readers = self._held_readers([a for a in self.pipeline.agents
                                      if (a.per_chunk if a.per_chunk is not None else not a.upstream)])
        for part in run.chunks or []:
            i = part.chunk.index
            if self.share_prefill:
                await self._acquire(run, None, self.source_alias, MemberPrompt(part.ids), chunk=i)
            for (member, _), agent in readers.items():
                await self._acquire(run, agent, member, await self.chunked.prompt(run, member, part), chunk=i)

    def _resume_state(self, run_id: str, document: str, inputs: dict[str, str], resume: bool) -> RunCheckpoint | None:
        """The checkpoint the run continues (recording its identity when it is new); None without a checkpointer."""
        if self.checkpointer is None:
            return None
        from orchestra.runs.checkpoint import RunIdentity, document_digest, pipeline_digest

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

    async def _prefix_ids(self, document: str, *, check: bool = True) -> list[int]:
        """The document prefix's token ids on the source, checked to leave every agent room for its reply."""
        from agents import DocumentPrompt
        from agents.errors import EmptyDocumentError

        tokenizer = await in_thread(self.cache.executor.tokenizer, self.source_alias)
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
        run = RunState(run_id, started, prefix_ids, emit, document=document, inputs=inputs, checkpointer=self.checkpointer)
        await self.chunked.plan(run)
        if state is not None:
            from orchestra.runs.checkpoint import RESTORABLE

            names = set(self.pipeline.upstreams())
            run.restored = {n: r for n, r in state.agents.items() if n in names and r.status in RESTORABLE}
            run.outputs.update({n: state.outputs[n] for n in run.restored if n in state.outputs})
        await emit(ev.RunStarted(run_id=run_id, agents=list(self.pipeline.upstreams()),
                                 source_model=self.source_alias, document_tokens=len(prefix_ids)))
        try:
            if self.share_prefill and run.chunks is not None:
                await self.chunked.prefill(run)
            elif self.share_prefill:
                lease = await self._acquire(run, None, self.source_alias)
                await emit(ev.DocumentPrefilled(run_id=run_id, model=self.source_alias, tokens=len(prefix_ids),
                                                seconds=lease.prefill_seconds, store_hit=lease.hit))
            done = {name: anyio.Event() for name in self.pipeline.upstreams()}
            async with anyio.create_task_group() as tg:
                for agent in self.pipeline.agents:
                    tg.start_soon(self.walk.agent_task, run, agent.name, done)
                for step in self.pipeline.steps:
                    tg.start_soon(self.walk.step_task, run, step, done)
        finally:
            for _, lease in run.leases:
                lease.release()
        report = await self._report(run, started, warned, moved)
        if run.checkpointer is not None:
            await in_thread(run.checkpointer.finish, run.run_id)
        return report

    async def _report(self, run: RunState, started: float, warned: int, moved: dict[str, int] | None = None) -> RunReport:
        reports = [run.reports[name] for name in self.pipeline.upstreams()]
        seconds = time.perf_counter() - started
        caches = cache_reports([lease for _, lease in run.leases])
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
            restored=list(run.restored), chunks=chunk_summaries(run), prefill_s_every_chunk=run.every_chunk_s,
            **{key: value - (moved or {}).get(key, 0) for key, value in self.cache.executor.stats().items()
               if key in _MOVED},
        )
        await run.emit(finished_event(report))
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

    async def _acquire(self, run: RunState, agent: str | None, member: str,
                       prompt: MemberPrompt | None = None, *, chunk: int | None = None,
                       mapped: bool = True, focus: Sequence[int] | None = None) -> CacheLease:
        """The document's (or a chunk's) cache on `member` from the FamilyCache, its steps re-emitted live as run
        events; `mapped` False: never mapped from the source (a reduce agent's notes exist on no other member);
        `focus`: the agent's suffix ids, for a repair that ranks what it recomputes by the agent's question."""
        node = self.pipeline.agent(agent) if agent is not None else None
        gate = (node.gate if node is not None else None) or self.pipeline.gate
        prompt = prompt or MemberPrompt(run.prefix_ids)
        if not self.cache.executor.holds_caches:  # the engines keep the caches (vLLM): held there, recorded here
            from orchestra.runs._engine import engine_lease

            lease = await engine_lease(self.cache.executor, run, agent, member, prompt.ids, chunk=chunk,
                                       mapped=self.share_prefill and prompt.own_reason is None and mapped)
            if lease.path != "mapped" and lease.computed_tokens:
                self.cache.measured_prefill(member, lease.prefill_seconds, lease.computed_tokens)
            run.leases.append((agent, lease))
            return lease
        repair = self._repair_for(agent, focus) if agent is not None else None
        # a member whose prefix has other ids prefills it itself: the source's cache (or a map of the
        # source's prefill of these ids, which costs the same prefill again) cannot serve it better
        lease = await self.cache.acquire(member, prompt.ids, gate=gate, repair=repair,
                                         on_step=step_sink(run, agent, chunk),
                                         allow_mapped=self.share_prefill and prompt.own_reason is None and mapped,
                                         reuse=self.share_prefill)
        run.leases.append((agent, lease))
        return lease

    async def settle(self, run: RunState, agent: str, lease: CacheLease, prompt: MemberPrompt,
                     decision: GateDecision) -> CacheLease:
        """The FamilyCache settles `agent`'s mapped lease on a gate decided after decoding (the answer gate), its
        steps re-emitted live as run events: `lease` itself when the gate passed, else the member's own prefill of
        the prompt (held by the run, as every lease it takes)."""
        settled = await self.cache.settle(lease, decision, prompt.ids, on_step=step_sink(run, agent))
        if settled is not lease:
            run.leases.append((agent, settled))
        return settled

    def _repair_for(self, agent: str, focus: Sequence[int] | None = None) -> RepairPolicy | None:
        """How a mapped cache `agent` reads is repaired: its node's, else its spec's (None: the cache's policy); a
        `focus: question` policy gets the agent's suffix ids (`focus`; without them the document's tail ranks)."""
        policy = self._asked_repair(agent)
        if policy is not None and policy.focus == "question":
            return policy.model_copy(update={"focus": tuple(int(i) for i in focus) if focus else None})
        return policy

    def gate_for(self, agent: str) -> GatePolicy | None:
        """The gates guarding `agent`'s mapped cache: its node's, else the pipeline's."""
        return self.pipeline.agent(agent).gate or self.pipeline.gate

    async def answer_check(self, run: RunState, agent: str, member: str, answer: AgentResult,
                           upstream: Mapping[str, object], policy: AnswerGate) -> GateDecision:
        """The answer gate on `answer`, the agent's reply on a mapped cache: the source answers the same prompt on
        its own cache of the document (decoding `policy.tokens` tokens) and the two replies' first tokens are
        compared."""
        from orchestra.familycache.gates import decide_answer

        spec = self.specs[agent]
        capped = spec.model_copy(update={"generation": spec.generation.model_copy(
            update={"max_new_tokens": min(spec.generation.max_new_tokens, policy.tokens)})})
        lease = await self.cache.acquire(self.source_alias, run.prefix_ids)
        try:
            source = await self.cache.executor.generate(self.source_alias, capped, prefix_ids=run.prefix_ids,
                                                        prefix_cache=lease.cache, upstream=dict(upstream))
        finally:
            lease.release()
        tokenizer = await in_thread(self.cache.executor.tokenizer, member)
        first = answer.token_ids[: policy.tokens]
        return decide_answer(policy, str(tokenizer.decode(first, skip_special_tokens=True)),
                             str(tokenizer.decode(source.token_ids[: policy.tokens], skip_special_tokens=True)))

    def _asked_repair(self, agent: str) -> RepairPolicy | None:
        """The repair `agent` asks for, as written: its node's, else its spec's."""
        node = self.pipeline.agent(agent)
        return node.repair if node.repair is not None else self.specs[agent].mapped_repair

    def wants_question_focus(self, agent: str) -> bool:
        """Whether `agent`'s repair ranks what it recomputes by the agent's own question (`focus: question`)."""
        policy = self._asked_repair(agent)
        return policy is not None and policy.focus == "question"

    async def question_focus(self, agent: str, member: str, upstream: Mapping[str, object]) -> list[int] | None:
        """The agent's suffix ids on `member` (its instructions and question, with `upstream`), when its repair is
        focused on its question; else None (nothing to lay out)."""
        if not self.wants_question_focus(agent):
            return None
        from agents import suffix_ids

        tokenizer = await in_thread(self.cache.executor.tokenizer, member)
        return suffix_ids(tokenizer, self.specs[agent], upstream)

    async def _prompt_for(self, run: RunState, agent: str, member: str) -> MemberPrompt:
        """The document prefix as `member`'s own tokenizer and chat template lay it out (once per member and run).

        Members share token ids (`ModelRegistry.check_family`), not necessarily a chat template: another
        template, or another BOS framing, gives the prefix other ids. The agent's suffix is laid out by the
        member's template, so its prefix must be too; its cache then cannot come from the source's.
        """
        if member == self.source_alias:
            return MemberPrompt(run.prefix_ids)
        if member not in run.prompts:
            run.prompts[member] = await in_thread(self._member_prompt, run.document,
                                                                 run.prefix_ids, member)
        prompt = run.prompts[member]
        if len(prompt.ids) != len(run.prefix_ids):
            self._check_length(prompt.ids, [agent])
        return prompt

    def _member_prompt(self, document: str, source_ids: list[int], member: str) -> MemberPrompt:
        """`member`'s prefix ids (blocking: loads its tokenizer); the source's own list when they are the same."""
        from agents import DocumentPrompt
        from mappings.tokenizer_compat import first_difference

        tokenizer = self.cache.executor.tokenizer(member)
        ids = DocumentPrompt(document).token_ids(tokenizer)
        first = first_difference(ids, source_ids)
        if first is None:
            return MemberPrompt(source_ids)
        source = self.cache.executor.tokenizer(self.source_alias)
        if self.cache.info(member).tokenizer_digest != self.cache.info(self.source_alias).tokenizer_digest:
            what = "tokenizer (another vocabulary or other merges)"
        elif getattr(tokenizer, "chat_template", None) != getattr(source, "chat_template", None):
            what = "chat template"
        else:
            what = "special-token framing (a leading BOS)"
        reason = (f"the member's {what} tokenizes the document prefix differently from the source's (first "
                  f"difference at token {first}): it cannot reuse the source's cache and prefilled the document itself")
        return MemberPrompt(ids, reason)


_MOVED = ("kv_bytes_moved", "kv_bytes_moved_across_nodes", "result_bytes_to_driver")
"""Executor counters the run report carries (what this run moved between processes)."""


def _default_family() -> FamilyManifest | None:
    from orchestra.family.manifest import load_family

    try:
        return load_family()
    except Exception:
        return None
