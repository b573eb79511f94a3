"""Chunked runs: a document longer than a window, cut into chunks, each prefilled once and read by map-reduce.

`ChunkedRuns.plan` cuts the document on structure when the pipeline's chunking says so (auto: only when it
does not fit), sized so every agent's prompt and reply fit beside a chunk; `prefill` computes each chunk once
on the source before any agent reads it (the other members map from it). A per-chunk agent runs once per chunk
(or on the k chunks BM25 ranks first against its question), its calls in parallel up to the executor's
parallelism; a reduce agent reads its upstreams' notes as its document, in rounds while they span several
windows. Each call's cache, cost and path are in the agent's report.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.abc

from agents.bridge import in_thread
from orchestra.errors import ChunkCallError, DocumentError
from orchestra.observability import events as ev
from orchestra.observability.report import AgentReport, ChunkCall
from orchestra.runs._mapreduce import Combined, Part, combine, notes_document, pointer, readable, round_label
from orchestra.runs._state import MemberPrompt, RunState, TokenSink, unavailable

if TYPE_CHECKING:
    from agents.runner import AgentResult
    from agents.spec import AgentSpec
    from orchestra.familycache import CacheLease, FamilyCache
    from orchestra.pipelines.spec import AgentNode, PipelineSpec

__all__ = ["ChunkedRuns", "held_key"]

_PATH_ORDER = ("exact", "mapped", "reprefilled")
_WINDOW_MARGIN = 16
"""Tokens a default chunk window leaves spare (a suffix laid out with other upstream text may be longer)."""
_MAX_ROUNDS = 8
"""Reduce rounds before a reduce that does not converge is given up."""


def held_key(document: str) -> str:
    """The key of a held document (a session's): its text's digest."""
    import hashlib

    return hashlib.sha256(document.encode("utf-8", "surrogatepass")).hexdigest()


class _Walk(Protocol):
    def record_cache(self, run: RunState, report: AgentReport, lease: CacheLease) -> None: ...

    async def checkpoint(self, run: RunState, report: AgentReport) -> None: ...


class _Orchestra(Protocol):
    """What a chunked run reads of the `Orchestra` it runs for."""

    pipeline: PipelineSpec
    specs: dict[str, AgentSpec]
    cache: FamilyCache
    share_prefill: bool
    source_alias: str
    _held_windows: dict[str, list[int]]

    @property
    def walk(self) -> _Walk: ...

    def _check_length(self, prefix_ids: list[int], agents: list[str] | None = None) -> None: ...

    async def _acquire(self, run: RunState, agent: str | None, member: str, prompt: MemberPrompt | None = None, *,
                       chunk: int | None = None, mapped: bool = True) -> CacheLease: ...

    def _member_prompt(self, document: str, source_ids: list[int], member: str) -> MemberPrompt: ...


class ChunkedRuns:
    """The chunked map-reduce of one `Orchestra`."""

    def __init__(self, orchestra: _Orchestra) -> None:
        self.o = orchestra

    async def plan(self, run: RunState) -> None:
        """Cut the document into chunks when the pipeline's chunking says so (auto: only when it does not fit);
        else check it fits, refusing it as always (mode never, or a document that fits)."""
        policy = self.o.pipeline.chunking
        refused: DocumentError | None = None
        if policy.mode != "always":
            try:
                self.o._check_length(run.prefix_ids)
                return
            except DocumentError as exc:
                if policy.mode == "never":
                    raise
                refused = exc
        self._check_chunk_agents()
        room = await in_thread(self._default_window, run)
        held = self.o._held_windows.get(held_key(run.document))
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
        from orchestra.documents.chunking import prefix_tokens, split_document

        tokenizer = await in_thread(self.o.cache.executor.tokenizer, self.o.source_alias)
        try:
            chunks = await in_thread(functools.partial(
                split_document, run.document, tokenizer, window, policy.overlap_tokens))
        except DocumentError as exc:
            raise DocumentError(f"{refused}; chunking cannot help: {exc}" if refused else str(exc)) from exc

        def layout() -> list[Part]:
            return [Part(c, c.label(len(chunks)), prefix_tokens(c.text, tokenizer), self.o.source_alias) for c in chunks]

        run.chunks, run.window = await in_thread(layout), window
        widest = max(run.chunks, key=lambda part: len(part.ids))
        try:
            self.o._check_length(widest.ids)
        except DocumentError as exc:
            raise DocumentError(f"{exc} (a chunk of {window} tokens): lower chunking.window_tokens") from exc

    def _check_chunk_agents(self) -> None:
        for agent in self.o.pipeline.agents:
            if agent.per_chunk is False and not agent.upstream:
                raise DocumentError(f"agent {agent.name!r} has per_chunk: false and no upstream agents, so a chunked "
                                    "run gives it nothing to read: set per_chunk: true (or chunking.mode: never)")

    def _default_window(self, run: RunState) -> int | None:
        """Prefix tokens every agent has room for after its suffix and new tokens (blocking: loads tokenizers)."""
        from agents.prompt import build_suffix

        limits = []
        for agent in self.o.pipeline.agents:
            info = self.o.cache.info(agent.model)
            if not info.max_positions:
                continue
            spec = self.o.specs[agent.name]
            values = {**{n: run.inputs[n] for n in self.o.pipeline.input_reads(agent.name)},
                      **{up: pointer(up) for up in agent.upstream}}
            suffix = build_suffix(self.o.cache.executor.tokenizer(agent.model), spec, values)
            kept = run.input_room * len(self.o.pipeline.input_reads(agent.name))
            limits.append(info.max_positions - len(suffix.ids) - spec.generation.max_new_tokens - 1 - _WINDOW_MARGIN
                          - kept)
        return min(limits) if limits else None

    async def prefill(self, run: RunState) -> None:
        """Each chunk prefilled once on the source, before any agent reads it (others map from it)."""
        for part in run.chunks or []:
            i = part.chunk.index
            lease = await self.o._acquire(run, None, self.o.source_alias, MemberPrompt(part.ids), chunk=i)
            run.source_prefill[i] = lease.prefill_seconds
            run.chunk_paths.setdefault(i, {})[self.o.source_alias] = lease.path
            await run.emit(ev.DocumentPrefilled(run_id=run.run_id, model=self.o.source_alias, tokens=len(part.ids),
                                                seconds=lease.prefill_seconds, store_hit=lease.hit, chunk=i))

    async def prompt(self, run: RunState, member: str, part: Part) -> MemberPrompt:
        """The part's prefix as `member` lays it out (once per member, round and chunk)."""
        if member == part.member:
            return MemberPrompt(part.ids)
        key = (member, part.round, part.chunk.index)
        if key not in run.chunk_prompts:
            run.chunk_prompts[key] = await in_thread(self.o._member_prompt, part.chunk.text, part.ids,
                                                                    member)
        return run.chunk_prompts[key]

    async def agent(self, run: RunState, name: str, report: AgentReport, on_token: TokenSink,
                             scope: contextlib.AbstractContextManager[object]) -> Combined:
        """A per-chunk agent over its chunks (map), or a reduce agent over its upstreams' combined outputs; all of
        its calls within `scope` (the agent's timeout)."""
        with scope:
            return await self._calls(run, name, report, on_token)

    async def _calls(self, run: RunState, name: str, report: AgentReport, on_token: TokenSink) -> Combined:
        agent = self.o.pipeline.agent(name)
        inputs = {n: run.inputs[n] for n in self.o.pipeline.input_reads(name)}
        per_chunk = agent.per_chunk if agent.per_chunk is not None else not agent.upstream
        if not per_chunk:
            return await self._reduce(run, name, report, inputs, on_token)
        upstream = {**inputs, **{up: run.outputs.get(up) or unavailable(up, report.missing_upstreams)
                                 for up in agent.upstream}}
        parts = run.chunks or []
        if agent.chunks != "all":
            from orchestra.documents.chunking import select_chunks

            chosen = select_chunks([p.chunk.text for p in parts], _retrieval_query(agent, self.o.specs[name], upstream),
                                   int(agent.chunks))
            parts = [parts[i] for i in chosen]
        results = await self._map(run, name, report, parts, upstream, on_token)
        return combine(self.o.specs[name].output.kind == "json", results)

    async def _reduce(self, run: RunState, name: str, report: AgentReport, inputs: dict[str, str],
                      on_token: TokenSink) -> Combined:
        """The agent over its upstreams' outputs as its document; notes longer than a window reduce in rounds
        (the agent over each chunk of them, joined, again) until one call reads them all."""
        from orchestra.documents.chunking import prefix_tokens, split_document

        agent = self.o.pipeline.agent(name)
        upstream = {**inputs, **{up: pointer(up) for up in agent.upstream}}
        notes = notes_document({up: self._notes(run, up, report) for up in agent.upstream})
        tokenizer = await in_thread(self.o.cache.executor.tokenizer, agent.model)
        json_output = self.o.specs[name].output.kind == "json"
        for round_ in range(1, _MAX_ROUNDS + 1):
            chunks = await in_thread(functools.partial(
                split_document, notes, tokenizer, run.window, self.o.pipeline.chunking.overlap_tokens))
            parts = [Part(c, round_label(c, len(chunks), round_),
                          await in_thread(prefix_tokens, c.text, tokenizer), agent.model, round_)
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

    @staticmethod
    def _notes(run: RunState, upstream: str, report: AgentReport) -> str:
        """What a reduce agent reads of an upstream: a JSON agent's parsed items as lines, else its output."""
        output = run.outputs.get(upstream)
        if not output:
            return unavailable(upstream, report.missing_upstreams)
        done = run.reports.get(upstream)
        return readable(done.parsed) if done is not None and done.parsed is not None else output

    async def _map(self, run: RunState, name: str, report: AgentReport, parts: list[Part], upstream: dict[str, str],
                   on_token: TokenSink) -> list[tuple[Part, AgentResult]]:
        """One call per part, up to `chunking.parallel_calls` at once (default: as many as the executor can run
        on the member); results, and the report's calls, in the parts' order whatever order they finish in."""
        agent = self.o.pipeline.agent(name)
        limit = self.o.pipeline.chunking.parallel_calls or self.o.cache.executor.parallelism(agent.model)
        results: list[AgentResult | None] = [None] * len(parts)
        limiter = anyio.CapacityLimiter(max(1, limit))

        failed: list[Exception] = []

        async def call(i: int, tg: anyio.abc.TaskGroup) -> None:
            async with limiter:
                try:
                    results[i] = await self._call(run, name, report, parts[i], upstream, on_token)
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

    async def _call(self, run: RunState, name: str, report: AgentReport, part: Part, upstream: dict[str, str],
                          on_token: TokenSink) -> AgentResult:
        """One call over one part's prefix, its cache acquired like a whole document's; recorded in the report."""
        agent = self.o.pipeline.agent(name)
        chunk = part.chunk.index if part.round == 0 else None
        prompt = await self.prompt(run, agent.model, part)
        lease = await self.o._acquire(run, name, agent.model, prompt, chunk=chunk, mapped=part.round == 0)
        scratch = AgentReport(name=name, model=agent.model, status="failed")
        self.o.walk.record_cache(run, scratch, lease)
        if prompt.own_reason is not None and self.o.share_prefill and scratch.fallback_reason is None:
            scratch.cache_path, scratch.fallback_reason = "reprefilled", prompt.own_reason
        await run.emit(ev.CacheReady(run_id=run.run_id, model=agent.model, agent=name,
                                     path=scratch.cache_path or lease.path,
                                     seconds=lease.seconds, store_hit=lease.hit, repair=lease.repair, chunk=chunk))
        where: dict[str, str] = {}
        try:
            result = await self.o.cache.executor.generate(agent.model, self.o.specs[name], prefix_ids=prompt.ids,
                                                        prefix_cache=lease.cache, upstream=upstream,
                                                        on_token=functools.partial(on_token, chunk=chunk),
                                                        placement=where)
        except Exception as exc:
            raise ChunkCallError(f"agent {name!r} failed on {part.label}: {type(exc).__name__}: {exc}") from exc
        finally:
            report.actor, report.node = where.get("actor"), where.get("node")
        estimate = self.o.cache.prefill_estimate(agent.model, len(prompt.ids))
        run.every_chunk_s += estimate
        if chunk is not None and scratch.cache_path is not None:
            run.chunk_paths.setdefault(chunk, {})[agent.model] = scratch.cache_path
        report.chunks.append(ChunkCall(
            index=part.chunk.index, label=part.label, round=part.round, cache_path=scratch.cache_path,
            prefix_tokens=len(prompt.ids), tokens=result.generated_tokens, prefill_s_spent=scratch.prefill_s_spent,
            prefill_s_saved=max(0.0, estimate - scratch.prefill_s_spent) if self.o.share_prefill else 0.0,
            degenerate_reason=str(result.degenerate) if result.degenerate is not None else None))
        report.gate += scratch.gate
        report.fallback_reason = report.fallback_reason or scratch.fallback_reason
        report.generation_s = (report.generation_s or 0.0) + result.timings.generation_s
        report.suffix_tokens = max(report.suffix_tokens, result.suffix_tokens)
        report.attempts, report.constrained = max(report.attempts, result.attempts), report.constrained or result.constrained
        report.duplicates_removed += result.duplicates_removed
        report.not_applied = sorted({*report.not_applied, *result.not_applied})
        return result

    async def finish(self, run: RunState, report: AgentReport, combined: Combined,
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
            await self.o.walk.checkpoint(run, report)
            await run.emit(ev.AgentDegenerate(run_id=run.run_id, agent=report.name, reason=combined.degenerate,
                                              output=combined.text))
            return
        run.outputs[report.name] = combined.downstream
        report.status = "succeeded"
        await self.o.walk.checkpoint(run, report)
        await run.emit(ev.AgentFinished(run_id=run.run_id, agent=report.name, output=combined.text,
                                        parsed=report.parsed))


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
