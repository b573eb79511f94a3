"""The DAG walk: every agent and step of a run as its own task, starting the moment its upstreams are done.

No supersteps: a slow sibling never holds back a fast branch. A node whose upstream gave nothing (failed,
degenerate, skipped) or whose condition is false is skipped with the reason, unless it runs on the upstreams
it has (`on_upstream_failure: run_with_available`). An agent gets its member's document cache from the
FamilyCache, decodes over a private copy, and its result is checkpointed before anyone hears of it; one
failing node fails alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from agents.bridge import in_thread
from orchestra.observability import events as ev
from orchestra.observability.report import AgentReport
from orchestra.pipelines.steps import StepNode, WhenLike, call_step, condition_holds
from orchestra.runs._state import MemberPrompt, RunState, jsonable, skip_reason, token_sink, unavailable

if TYPE_CHECKING:
    from agents.runner import AgentResult
    from agents.spec import AgentSpec
    from orchestra.familycache import CacheLease, FamilyCache
    from orchestra.familycache.gates import AnswerGate, GateDecision, GatePolicy
    from orchestra.pipelines.spec import AgentNode, PipelineSpec
    from orchestra.runs._chunked import ChunkedRuns
    from orchestra.runs._state import TokenSink

__all__ = ["DagWalk"]


class _Orchestra(Protocol):
    """What the walk reads of the `Orchestra` it runs for."""

    pipeline: PipelineSpec
    specs: dict[str, AgentSpec]
    cache: FamilyCache
    share_prefill: bool

    @property
    def chunked(self) -> ChunkedRuns: ...

    async def _prompt_for(self, run: RunState, agent: str, member: str) -> MemberPrompt: ...

    async def _acquire(self, run: RunState, agent: str | None, member: str, prompt: MemberPrompt | None = None, *,
                       chunk: int | None = None, mapped: bool = True,
                       focus: Sequence[int] | None = None) -> CacheLease: ...

    async def question_focus(self, agent: str, member: str, upstream: Mapping[str, object]) -> list[int] | None: ...

    def gate_for(self, agent: str) -> GatePolicy | None: ...

    async def answer_check(self, run: RunState, agent: str, member: str, answer: AgentResult,
                           upstream: Mapping[str, object], policy: AnswerGate) -> GateDecision: ...

    async def settle(self, run: RunState, agent: str, lease: CacheLease, prompt: MemberPrompt,
                     decision: GateDecision) -> CacheLease: ...


class DagWalk:
    """The nodes of one `Orchestra`'s runs."""

    def __init__(self, orchestra: _Orchestra) -> None:
        self.o = orchestra

    async def agent_task(self, run: RunState, name: str, done: dict[str, anyio.Event]) -> None:
        """Agent ``name``'s node: after its upstreams it is skipped, or runs over its member's cache; it ends
        recorded and announced (finished, degenerate or failed), and ``done[name]`` is set however it ends."""
        agent = self.o.pipeline.agent(name)
        if await self._restored(run, name, done):
            return
        report = AgentReport(name=name, model=agent.model, status="failed")
        run.reports[name] = report
        try:
            if await self._wait_or_skip(run, report, agent.upstream, agent.on_upstream_failure, agent.condition, done):
                return
            await run.emit(ev.AgentStarted(run_id=run.run_id, agent=name, model=agent.model))
            first_token: list[float] = []
            on_token = token_sink(run, name, first_token)

            scope = anyio.fail_after(agent.timeout_s) if agent.timeout_s else contextlib.nullcontext()
            if run.chunks is not None:
                await self.o.chunked.finish(run, report, await self.o.chunked.agent(run, name, report, on_token, scope),
                                           first_token)
                return
            with scope:
                prompt = await self.o._prompt_for(run, name, agent.model)
                upstream = self._upstream(run, agent, report)
                focus = await self.o.question_focus(name, agent.model, upstream)
                lease = await self._agent_cache(run, report, prompt, focus)
                answer_gate = self._answer_gate_for(agent, lease)
                # an answer the gate may replace streams only once the gate has kept it
                held = _HeldTokens(on_token) if answer_gate is not None else None
                result = await self._generate(run, agent, report, prompt, lease, held or on_token, upstream)
                if answer_gate is not None and held is not None:
                    result = await self._answer_gate(run, agent, report, prompt, lease, result, answer_gate,
                                                     on_token, upstream, held)
            await self._record_result(run, report, result, len(prompt.ids), first_token)
            await self._conclude(run, report, result)
        except Exception as exc:
            await self._failed(run, report, exc, agent.timeout_s)
        finally:
            done[name].set()

    async def _agent_cache(self, run: RunState, report: AgentReport, prompt: MemberPrompt,
                           focus: list[int] | None = None) -> CacheLease:
        """Acquire the agent's document cache on its member (a question-focused repair ranks by `focus`), record it
        on the report and announce it."""
        name, model = report.name, report.model
        lease = await self.o._acquire(run, name, model, prompt, focus=focus)
        self.record_cache(run, report, lease)
        if prompt.own_reason is not None and self.o.share_prefill and report.fallback_reason is None:
            report.cache_path, report.fallback_reason = "reprefilled", prompt.own_reason
            await run.emit(ev.Fallback(run_id=run.run_id, agent=name, model=model, reason=prompt.own_reason))
        await self._cache_ready(run, report, lease)
        return lease

    async def _cache_ready(self, run: RunState, report: AgentReport, lease: CacheLease) -> None:
        await run.emit(ev.CacheReady(run_id=run.run_id, model=report.model, agent=report.name,
                                     path=report.cache_path or lease.path, seconds=lease.seconds, store_hit=lease.hit,
                                     repair=lease.repair))

    def _answer_gate_for(self, agent: AgentNode, lease: CacheLease) -> AnswerGate | None:
        """The answer gate the agent's answer goes through: its gates' one when it runs on a mapped cache. An
        agent with tools is not checked (the source's answer would run them again), nor one on vLLM engines
        (they hold the caches: there is no source lease here)."""
        gate = self.o.gate_for(agent.name)
        if (gate is None or lease.path != "mapped" or self.o.specs[agent.name].tools
                or not self.o.cache.executor.holds_caches):
            return None
        return gate.answer

    async def _answer_gate(self, run: RunState, agent: AgentNode, report: AgentReport, prompt: MemberPrompt,
                           lease: CacheLease, result: AgentResult, policy: AnswerGate, on_token: TokenSink,
                           upstream: dict[str, object], held: _HeldTokens) -> AgentResult:
        """The answer gate: the result kept (its held tokens then stream), or dropped unstreamed for the agent's
        answer again on its member's own prefill, which the FamilyCache hands out when the source answers too
        differently."""
        decision = await self.o.answer_check(run, agent.name, agent.model, result, upstream, policy)
        settled = await self.o.settle(run, agent.name, lease, prompt, decision)
        if settled is lease:
            report.gate = lease.gate_dicts()
            await held.release()
            return result
        self.record_cache(run, report, settled)
        await self._cache_ready(run, report, settled)
        return await self._generate(run, agent, report, prompt, settled, on_token, upstream)

    def _upstream(self, run: RunState, agent: AgentNode, report: AgentReport) -> dict[str, object]:
        """What the agent's templates read: the run's inputs it names and its upstreams' outputs."""
        return {**{n: run.inputs[n] for n in self.o.pipeline.input_reads(agent.name)},
                **{up: run.outputs.get(up) or unavailable(up, report.missing_upstreams) for up in agent.upstream}}

    async def _generate(self, run: RunState, agent: AgentNode, report: AgentReport, prompt: MemberPrompt,
                        lease: CacheLease, on_token: TokenSink, upstream: dict[str, object]) -> AgentResult:
        """Run the agent over its cache with its upstreams' outputs; where it ran goes on the report, also on failure."""
        name = agent.name
        where: dict[str, str] = {}
        try:
            return await self.o.cache.executor.generate(
                agent.model, self.o.specs[name], prefix_ids=prompt.ids, prefix_cache=lease.cache,
                upstream=upstream, on_token=on_token, placement=where,
            )
        finally:
            report.actor, report.node = where.get("actor"), where.get("node")

    async def _record_result(self, run: RunState, report: AgentReport, result: AgentResult, prompt_tokens: int,
                             first_token: list[float]) -> None:
        """Put what the agent produced and what it cost on its report; its tool calls are announced on the way."""
        report.output = result.output_text()
        report.parsed = jsonable(result.parsed)
        report.attempts = result.attempts
        report.constrained = result.constrained
        report.grounding = jsonable(result.grounding)
        report.duplicates_removed = result.duplicates_removed
        report.not_applied = list(result.not_applied)
        report.tool_calls = [call.as_dict() for call in result.tool_calls]
        await self._emit_tool_calls(run, report.name, result)
        report.tokens = result.generated_tokens
        report.suffix_tokens = result.suffix_tokens
        report.generation_s = result.timings.generation_s
        report.ttft_s = (first_token[0] - run.started) if first_token else None
        estimate = self.o.cache.prefill_estimate(report.model, prompt_tokens)
        report.prefill_s_saved = max(0.0, estimate - report.prefill_s_spent) if self.o.share_prefill else 0.0

    async def _conclude(self, run: RunState, report: AgentReport, result: AgentResult) -> None:
        """Checkpoint the agent and announce it: degenerate, or finished with its output handed downstream."""
        name = report.name
        if result.degenerate is not None:
            # never handed downstream as an answer: dependants are skipped, naming this agent and why
            report.status = "degenerate"
            report.degenerate_reason = str(result.degenerate)
            await self.checkpoint(run, report)
            await run.emit(ev.AgentDegenerate(run_id=run.run_id, agent=name, reason=report.degenerate_reason,
                                              output=result.text))
            return
        run.outputs[name] = result.downstream_text()
        report.status = "succeeded"
        await self.checkpoint(run, report)
        await run.emit(ev.AgentFinished(run_id=run.run_id, agent=name, output=report.output, parsed=report.parsed))

    async def _failed(self, run: RunState, report: AgentReport, exc: Exception, timeout_s: float | None) -> None:
        """Record the node as failed with its error (a timeout named as one), checkpoint it and announce it."""
        report.status = "failed"
        report.error_type = type(exc).__name__
        report.error = str(exc) or (f"timed out after {timeout_s}s" if isinstance(exc, TimeoutError) else "")
        await self.checkpoint(run, report)
        await run.emit(ev.AgentFailed(run_id=run.run_id, agent=report.name, error_type=report.error_type,
                                      error=report.error))

    @staticmethod
    async def _emit_tool_calls(run: RunState, name: str, result: AgentResult) -> None:
        for call in result.tool_calls:
            await run.emit(ev.ToolCallEvent(run_id=run.run_id, agent=name, tool=call.name,
                                            arguments=call.arguments, round=call.round))
            await run.emit(ev.ToolResultEvent(run_id=run.run_id, agent=name, tool=call.name, result=call.result,
                                              ok=call.ok, seconds=call.seconds, round=call.round))

    async def _restored(self, run: RunState, name: str, done: dict[str, anyio.Event]) -> bool:
        """Keep a node's result from the run's checkpoint (a resumed run); True when it was kept."""
        if name not in run.restored:
            return False
        kept = run.reports[name] = run.restored[name]
        try:
            await run.emit(ev.AgentRestored(run_id=run.run_id, agent=name, status=kept.status, output=kept.output))
        finally:
            done[name].set()
        return True

    async def _wait_or_skip(self, run: RunState, report: AgentReport, upstream: list[str], on_failure: str,
                            condition: WhenLike | None, done: dict[str, anyio.Event]) -> bool:
        """Wait for the node's upstreams; skip it (True) when one it needs gave nothing or its condition is false."""
        for up in upstream:
            await done[up].wait()
        bad = [up for up in upstream if run.reports[up].status != "succeeded"]
        if bad and on_failure == "run_with_available" and len(bad) < len(upstream):
            report.missing_upstreams = {up: skip_reason([run.reports[up]]) for up in bad}
            bad = []
        return await self._skipped(run, report, upstream, bad, condition)

    async def _skipped(self, run: RunState, report: AgentReport, upstream: list[str], bad: list[str],
                       condition: WhenLike | None) -> bool:
        """Skip the node (reported, recorded, announced) when an upstream it needs gave nothing or its condition is
        false; True when it was skipped."""
        if bad:
            report.skip_reason = skip_reason([run.reports[up] for up in bad])
        else:
            holds, what = condition_holds(condition, {up: run.outputs.get(up, "") for up in upstream})
            if holds:
                return False
            report.skip_reason = f"its condition is false: {what}"
        report.status = "skipped"
        await self.checkpoint(run, report)
        await run.emit(ev.AgentSkipped(run_id=run.run_id, agent=report.name, reason=report.skip_reason))
        return True

    async def step_task(self, run: RunState, step: StepNode, done: dict[str, anyio.Event]) -> None:
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
            await self.checkpoint(run, report)
            await run.emit(ev.AgentFinished(run_id=run.run_id, agent=name, output=output))
        except Exception as exc:
            await self._failed(run, report, exc, step.timeout_s)
        finally:
            done[name].set()

    async def checkpoint(self, run: RunState, report: AgentReport) -> None:
        """Record a finished agent before anyone hears of it (a run killed after the event has it on record)."""
        if run.checkpointer is not None:
            await in_thread(run.checkpointer.record, run.run_id, report, run.outputs.get(report.name))

    def record_cache(self, run: RunState, report: AgentReport, lease: CacheLease) -> None:
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


class _HeldTokens:
    """A token sink that keeps what it is given until released: an answer the gate may still drop never
    reaches a client."""

    def __init__(self, sink: TokenSink) -> None:
        self._sink = sink
        self._held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def __call__(self, *args: Any, **kwargs: Any) -> None:
        self._held.append((args, kwargs))

    async def release(self) -> None:
        """Nothing: the held tokens go to the sink, in order."""
        held, self._held = self._held, []
        for args, kwargs in held:
            await self._sink(*args, **kwargs)
