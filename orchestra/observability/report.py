"""The run report: per agent, which cache it ran on, what the gates said, what it cost and saved."""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import BaseModel, Field

from orchestra.errors import UnknownAgentError

__all__ = ["AgentReport", "ChunkCall", "ChunkSummary", "ModelCacheReport", "RunReport"]


class ModelCacheReport(BaseModel):
    """How the document's cache was obtained for one model."""

    model: str
    path: Literal["exact", "mapped", "reprefilled"]
    seconds: float = Field(description="Wall seconds to obtain it (prefill, or map + tail recompute).")
    store_hit: bool = False
    mapping: str | None = Field(None, description="Mapping directory used, for mapped caches.")
    tail_tokens: int = 0
    from_disk: bool = Field(False, description="Read from the disk tier (a cache an earlier run or process built).")
    disk_load_s: float = Field(0.0, description="Seconds reading it from the disk tier.")
    disk_tokens: int = Field(0, description="Positions of it read from the disk tier.")
    repair: dict[str, object] | None = Field(
        None, description="Map-then-repair plan for mapped caches: recomputed tokens, tail, layer blocks, cost."
    )


class ChunkCall(BaseModel):
    """One call of a chunked agent: over a document chunk (map), or over a chunk of combined notes (reduce)."""

    index: int = Field(description="The chunk's 0-based index (of the document, or of that reduce round's notes).")
    label: str = Field(description="How its output is headed: [chunk 2/5, page 3].")
    round: int = Field(0, description="0: a chunk of the document; n >= 1: reduce round n over combined notes.")
    cache_path: Literal["exact", "mapped", "reprefilled"] | None = None
    prefix_tokens: int = Field(0, description="Token ids of the chunk's prefix.")
    tokens: int = Field(0, description="Tokens the call generated.")
    prefill_s_spent: float = Field(0.0, description="Prefill seconds this call paid for (a shared cache: once).")
    prefill_s_saved: float = Field(0.0, description="Estimated prefill seconds saved versus re-prefilling the chunk.")
    degenerate_reason: str | None = Field(None, description="Why this call's output was left out, if it was.")


class ChunkSummary(BaseModel):
    """One chunk of a chunked run's document: where it lies, its size, and how each member got its cache."""

    index: int
    label: str
    anchor: str | None = Field(None, description="The page or heading the chunk starts under.")
    start: int = Field(0, description="Character offset in the document.")
    end: int = Field(0, description="Character offset in the document where it ends (exclusive).")
    tokens: int = Field(0, description="Token ids of its prefix on the source.")
    paths: dict[str, str] = Field(default_factory=dict, description="Model alias -> the cache path it got.")
    source_prefill_s: float = Field(0.0, description="Seconds the source spent prefilling it (once per run).")


class AgentReport(BaseModel):
    """One agent's outcome."""

    name: str
    model: str
    status: Literal["succeeded", "failed", "skipped", "cancelled", "degenerate"]
    """degenerate: the agent ran but its output is not a real answer (empty, whitespace, a loop, a copied
    example); it is kept in ``output`` for inspection and never passed to downstream agents."""
    cache_path: Literal["exact", "mapped", "reprefilled"] | None = None
    gate: list[dict[str, object]] = Field(default_factory=list, description="Each gate's decision, reason and metrics.")
    fallback_reason: str | None = None
    output: str | None = None
    parsed: object = None
    error_type: str | None = None
    error: str | None = None
    skip_reason: str | None = None
    missing_upstreams: dict[str, str] = Field(
        default_factory=dict, description="on_upstream_failure: run_with_available: the upstreams it ran without, "
        "and why each gave nothing (its prompt said so).")
    duplicates_removed: int = Field(0, description="JSON agents: repeated list items dropped from the reply.")
    not_applied: list[str] = Field(default_factory=list, description="Settings of the agent the engine that decoded "
                                   "it could not apply (vLLM has no n-gram ban, ...), each with why.")
    tool_calls: list[dict[str, object]] = Field(
        default_factory=list, description="Agents with tools: each call (name, arguments, result, ok, seconds, round).")
    degenerate_reason: str | None = Field(
        None, description="Why the output is degenerate (the rule that fired and its numbers), for status 'degenerate'.")
    attempts: int = Field(1, description="Generations it took (1 + JSON repairs).")
    constrained: bool = Field(False, description="A JSON grammar constrained the agent's decoding (xgrammar).")
    grounding: dict[str, object] | None = Field(
        None, description="Grounded JSON agents: items checked, grounded (verbatim in the document), and the "
        "ungrounded ones (dropped from the output).")
    ttft_s: float | None = Field(None, description="Seconds from the run start to this agent's first token.")
    tokens: int = 0
    suffix_tokens: int = 0
    generation_s: float | None = None
    prefill_s_spent: float = Field(0.0, description="Document prefill seconds spent for this agent (re-prefills).")
    prefill_s_saved: float = Field(0.0, description="Estimated prefill seconds saved versus re-prefilling for it.")
    actor: str | None = Field(None, description="The ray executor's actor that ran it (``alias#replica``); None locally.")
    node: str | None = Field(None, description="The node that actor ran on (``ip/node-id``); None locally.")
    chunks: list[ChunkCall] = Field(default_factory=list, description="Chunked runs: each call, in order.")


class RunReport(BaseModel):
    """A whole run."""

    run_id: str
    pipeline: str
    source_model: str
    document_tokens: int
    agents: list[AgentReport]
    caches: list[ModelCacheReport]
    seconds: float
    prefill_s_spent: float
    prefill_s_saved: float
    store_hits: int
    store_misses: int
    store_hit_rate: float
    disk_loads: int = Field(0, description="Caches read from the disk tier instead of being computed.")
    disk_load_s: float = Field(0.0, description="Seconds spent reading them (not counted in prefill_s_spent).")
    warnings: list[str] = Field(default_factory=list, description="e.g. mappings calibrated on demand")
    inputs: dict[str, str] = Field(default_factory=dict, description="The run's values of the pipeline's inputs.")
    restored: list[str] = Field(default_factory=list, description="Agents a resumed run kept from its checkpoint "
                                "(not run again).")
    executor: str = Field("local", description="Where model work ran: local (this process) or ray (actors).")
    kv_bytes_moved: int = Field(
        0, description="ray: bytes of K/V (and hidden states) one process read from another's output during the run "
        "(a source's cache into a target's actor, a lease into an agent's actor); 0 locally.")
    kv_bytes_moved_across_nodes: int = Field(0, description="ray: the part of kv_bytes_moved that crossed nodes.")
    result_bytes_to_driver: int = Field(
        0, description="ray: bytes of tensors returned to the driver (the tail logits the gates read).")
    chunks: list[ChunkSummary] = Field(default_factory=list, description="Chunked runs: the document's chunks.")
    prefill_s_every_chunk: float = Field(
        0.0, description="Chunked runs: estimated prefill seconds had every chunk call re-prefilled its chunk "
        "(compare with prefill_s_spent).")

    def agent(self, name: str) -> AgentReport:
        """The report of the agent (or step) called ``name``; `UnknownAgentError` names the ones it has."""
        for agent in self.agents:
            if agent.name == name:
                return agent
        names = [a.name for a in self.agents]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        has = f"it has {', '.join(names)}" if names else "it has no agents"
        raise UnknownAgentError(f"no agent {name!r} in this report{hint}: {has}")

    @property
    def succeeded(self) -> list[str]:
        return [a.name for a in self.agents if a.status == "succeeded"]

    @property
    def degenerate(self) -> list[str]:
        return [a.name for a in self.agents if a.status == "degenerate"]
