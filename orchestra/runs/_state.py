"""A pipeline run's state while it runs, and the small translations every part of a run shares.

`RunState` is what one run of `Orchestra` knows as it goes: the document's prefix, the leases it holds, each
node's output and report, the inputs, a resumed run's restored nodes, and a chunked run's chunks and costs.
The scheduler, the DAG walk and the chunked map-reduce all read and write it; nothing outlives the run.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agents.bridge import call_in_loop
from orchestra.familycache import CacheLease, CacheStep
from orchestra.observability import events as ev
from orchestra.observability.report import AgentReport, ChunkSummary, ModelCacheReport, RunReport
from orchestra.runs._mapreduce import Part

if TYPE_CHECKING:
    from orchestra.runs.checkpoint import Checkpointer

__all__ = ["EventSink", "MemberPrompt", "RunState", "TokenSink", "cache_reports", "chunk_summaries", "finished_event", "jsonable", "skip_reason",
           "step_event", "step_sink", "token_sink", "unavailable"]

EventSink = Callable[[ev.Event], Awaitable[None] | None]
TokenSink = Callable[..., Awaitable[None]]


@dataclass(frozen=True)
class MemberPrompt:
    """The document prefix's token ids on one member, and why it cannot reuse the source's cache (None: it can)."""

    ids: list[int]
    own_reason: str | None = None


@dataclass
class RunState:
    """One run's state: created when it starts, read by every part of the run, gone when it ends."""

    run_id: str
    started: float
    prefix_ids: list[int]
    emit: Callable[[ev.Event], Coroutine[object, object, None]]  # a coroutine: call_in_loop takes no other
    leases: list[tuple[str | None, CacheLease]] = field(default_factory=list)
    charged: set[int] = field(default_factory=set)
    outputs: dict[str, str] = field(default_factory=dict)
    reports: dict[str, AgentReport] = field(default_factory=dict)
    document: str = ""
    inputs: dict[str, str] = field(default_factory=dict)
    """The run's values of the pipeline's declared inputs (defaults filled in)."""
    prompts: dict[str, MemberPrompt] = field(default_factory=dict)
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
    chunk_prompts: dict[tuple[str, int, int], MemberPrompt] = field(default_factory=dict)
    """(member, round, chunk) -> that chunk's prefix on the member."""
    chunk_paths: dict[int, dict[str, str]] = field(default_factory=dict)
    """Document chunk -> model alias -> the cache path it got."""
    source_prefill: dict[int, float] = field(default_factory=dict)
    """Document chunk -> seconds the source spent prefilling it."""
    every_chunk_s: float = 0.0
    """Estimated prefill seconds had every chunk call re-prefilled its chunk."""


def step_event(run_id: str, agent: str | None, step: CacheStep, chunk: int | None = None) -> ev.Event:
    """Gate and fallback steps keep their own event kinds; every other step is a `cache_step` event."""
    if step.step in ("gate", "shadow") and agent is not None:
        return ev.GateResult(run_id=run_id, agent=agent, model=step.member, passed=bool(step.passed),
                             reason=step.reason or "", metrics=step.metrics, chunk=chunk)
    if step.step == "fallback" and agent is not None:
        return ev.Fallback(run_id=run_id, agent=agent, model=step.member, reason=step.reason or "", chunk=chunk)
    return ev.CacheStepEvent(run_id=run_id, agent=agent, step=step, chunk=chunk)


def step_sink(run: RunState, agent: str | None, chunk: int | None = None) -> Callable[[CacheStep], None]:
    """A FamilyCache step sink that re-emits each step live as the run's event (called from the cache's worker
    thread)."""

    def on_step(step: CacheStep) -> None:
        call_in_loop(run.emit, step_event(run.run_id, agent, step, chunk))

    return on_step


def token_sink(run: RunState, name: str, first_token: list[float]) -> TokenSink:
    """The agent's token events (with the chunk its call reads, in chunked runs); notes when the first came."""

    async def on_token(token: Any, chunk: int | None = None) -> None:
        if not first_token:
            first_token.append(time.perf_counter())
        await run.emit(ev.TokenEvent(run_id=run.run_id, agent=name, text=token.text, index=token.index, chunk=chunk))

    return on_token


def chunk_summaries(run: RunState) -> list[ChunkSummary]:
    return [ChunkSummary(index=p.chunk.index, label=p.label, anchor=p.chunk.anchor, start=p.chunk.start,
                         end=p.chunk.end, tokens=len(p.ids), paths=run.chunk_paths.get(p.chunk.index, {}),
                         source_prefill_s=run.source_prefill.get(p.chunk.index, 0.0)) for p in run.chunks or []]


def unavailable(upstream: str, missing: dict[str, str]) -> str:
    """What an agent run on the upstreams it has reads in place of one that gave nothing."""
    return f"(not available: {missing.get(upstream, 'upstream ' + upstream + ' gave no output')})"


def skip_reason(bad: list[AgentReport]) -> str:
    """Why a downstream agent is skipped, naming each upstream whose output it cannot use."""
    failed = [up.name for up in bad if up.status != "degenerate"]
    parts = [f"upstream {', '.join(failed)} did not succeed"] if failed else []
    parts += [f"upstream {up.name} produced degenerate output ({up.degenerate_reason})"
              for up in bad if up.status == "degenerate"]
    return "; ".join(parts)


def jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def cache_reports(leases: list[CacheLease]) -> list[ModelCacheReport]:
    """One line per cache the run used, from the lease that built it (not one that joined it); aliases of one
    model share entries, so a cache is reported once."""
    builders: dict[int, CacheLease] = {}

    def work(lease: CacheLease) -> tuple[float, bool]:
        return lease.prefill_seconds + lease.map_seconds, not lease.hit

    for lease in leases:
        key = lease.entry_id or id(lease)
        if key not in builders or work(lease) > work(builders[key]):
            builders[key] = lease
    return [ModelCacheReport(model=lease.member, path=lease.path, seconds=lease.prefill_seconds + lease.map_seconds,
                             store_hit=lease.hit, mapping=lease.mapping, tail_tokens=lease.tail_tokens,
                             repair=lease.repair, from_disk=lease.loaded_tokens > 0, disk_load_s=lease.load_seconds,
                             disk_tokens=lease.loaded_tokens)
            for lease in builders.values()]


def finished_event(report: RunReport) -> ev.RunFinished:
    """The run's last event: who succeeded, failed, was skipped or degenerate, and the report."""
    agents = report.agents
    return ev.RunFinished(run_id=report.run_id, succeeded=[r.name for r in agents if r.status == "succeeded"],
                          failed=[r.name for r in agents if r.status == "failed"],
                          skipped=[r.name for r in agents if r.status == "skipped"], seconds=report.seconds,
                          degenerate=[r.name for r in agents if r.status == "degenerate"], report=report)
