"""A run's document caches where an engine keeps them (``executor: vllm``): held there, leased here as records.

An executor whose engines keep their own caches (`Executor.holds_caches` False) is asked to hold each prefix
in the member's engine (`Executor.engine_cache`): the source's engine computes and saves the document once,
and every other member's engine loads it through the family connector, mapped and gated, or computes it when
the map is refused. The run records that as a `CacheLease` without a cache (the engine has it), so the
report, the events and the prefill accounting read the same as for a cache held in process.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from agents.bridge import in_thread
from orchestra.familycache import CacheLease
from orchestra.familycache.gates import GateDecision
from orchestra.observability import events as ev

if TYPE_CHECKING:
    from orchestra.familycache._executor import Executor
    from orchestra.familycache._handles import CacheRef
    from orchestra.familycache._requests import EngineCache
    from orchestra.runs._state import RunState

__all__ = ["engine_lease"]


async def engine_lease(executor: Executor, run: RunState, agent: str | None, member: str, ids: Sequence[int], *,
                       mapped: bool, chunk: int | None = None) -> CacheLease:
    """`ids` held in `member`'s engine, as a lease record; gate verdicts and a refused map are run events."""
    held = await in_thread(lambda: executor.engine_cache(member, ids, mapped=mapped))
    gates = [_decision(g) for g in held.gates]
    if agent is not None:
        for decision in gates:
            await run.emit(ev.GateResult(run_id=run.run_id, agent=agent, model=member, passed=decision.passed,
                                         reason=decision.reason, chunk=chunk))
        if held.path == "reprefilled":
            await run.emit(ev.Fallback(run_id=run.run_id, agent=agent, model=member, reason=held.reason or "",
                                       chunk=chunk))
    return _lease(member, ids, held, gates)


def _lease(member: str, ids: Sequence[int], held: EngineCache, gates: list[GateDecision]) -> CacheLease:
    # one entry per member and prefix, as the engine keys it: a second lease on it is a hit, charged once
    entry = zlib.crc32(f"{member}:{','.join(map(str, ids))}".encode())
    path = held.path if held.path in ("exact", "mapped", "reprefilled") else "exact"
    return CacheLease(
        member=member, tokens=len(ids), cache=cast("CacheRef", None), path=path,  # type: ignore[arg-type]
        reused_tokens=held.tokens, computed_tokens=held.computed, source=held.source, gates=gates,
        fallback_reason=held.reason if path == "reprefilled" else None, seconds=held.seconds,
        prefill_seconds=held.seconds if path != "mapped" and held.computed else 0.0,
        map_seconds=held.seconds if path == "mapped" else 0.0, hit=held.computed == 0 and path == "exact",
        entry_id=entry)


def _decision(verdict: str) -> GateDecision:
    """``"offline=pass"`` (the connector's event) as a gate decision."""
    gate, _, outcome = verdict.partition("=")
    return GateDecision(passed=outcome == "pass", gate=gate, reason=f"{gate} gate {outcome or 'unknown'} in the engine")
