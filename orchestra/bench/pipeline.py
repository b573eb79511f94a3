"""Pipeline: prefill once and map vs every agent re-prefilling the document, in one process.

:func:`compare_pipeline` is the measurement behind ``benchmarks/pipeline_ttft.py`` too: the same
pipeline runs shared (one source prefill, mapped or exact caches elsewhere, gates on) and as the
baseline (``share_prefill=False``) on the same loaded models and mapping store, after an untimed
warm-up that loads models and calibrates missing mappings; each repeat starts from a fresh KV
store. :func:`run_pipeline` builds N-agent pipelines over distinct members and compares each.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from agents.bridge import run_blocking

if TYPE_CHECKING:
    from orchestra.bench._context import BenchFamily
    from orchestra.pipelines.spec import PipelineSpec
    from orchestra.runs.scheduler import Orchestra

__all__ = ["PipelineAgentRow", "PipelineComparison", "PipelineConfig", "PipelineSection", "compare_pipeline",
           "build_pipeline", "run_pipeline", "pipeline_markdown"]

# The example pipeline's gates: what a real run would apply.
DEFAULT_GATE: dict[str, dict[str, float]] = {"offline": {"max_kl": 0.1}, "probe": {"tokens": 32, "max_excess_nll": 0.25,
                                                                        "max_excess_kl": 0.1}}


def _default_gate() -> dict[str, object]:
    return dict(DEFAULT_GATE)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PipelineAgentRow(_Model):
    agent: str
    model: str
    cache_path: str | None = Field(description="exact, mapped or reprefilled (last shared repeat)")
    fallback_reason: str | None
    ttft_shared_s: float | None
    ttft_baseline_s: float | None
    ttft_ratio_baseline_over_shared: float | None
    same_output_as_baseline: bool


class PipelineComparison(_Model):
    """One pipeline, shared vs per-agent re-prefill (medians over repeats)."""

    pipeline: str
    agents_count: int
    members: list[str] = Field(description="distinct models the agents run on")
    document_tokens: int
    repeats: int
    agents: list[PipelineAgentRow]
    fallbacks: int = Field(description="agents the gates sent to re-prefill (last shared repeat)")
    total_prefill_s_shared: float
    total_prefill_s_baseline: float
    prefill_ratio_baseline_over_shared: float | None
    run_s_shared: float
    run_s_baseline: float
    run_ratio_baseline_over_shared: float | None
    caches: list[dict[str, object]] = Field(default_factory=list, description="how each model's cache was obtained")
    warnings: list[str] = Field(default_factory=list)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_pipeline(shared: Orchestra, baseline: Orchestra, document: str, *, repeats: int = 1,
                     warmup: bool = True) -> PipelineComparison:
    """Run ``shared`` and ``baseline`` (same spec, ``share_prefill=False``) ``repeats`` times each."""

    spec = shared.pipeline
    if warmup:
        run_blocking(shared.run, document)  # loads models, calibrates missing mappings, measures probe references
    runs = []
    for _ in range(repeats):
        shared.cache.clear()  # every repeat prefills the document again: the warm-up's caches do not count
        a = run_blocking(shared.run, document)
        b = run_blocking(baseline.run, document)
        runs.append((a, b))

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if values and len(present) == len(values) else None

    rows = []
    for agent in spec.agents:
        sa = [r[0].agent(agent.name) for r in runs]
        ba = [r[1].agent(agent.name) for r in runs]
        ts, tb = med([x.ttft_s for x in sa]), med([x.ttft_s for x in ba])
        rows.append(PipelineAgentRow(
            agent=agent.name, model=agent.model, cache_path=sa[-1].cache_path, fallback_reason=sa[-1].fallback_reason,
            ttft_shared_s=ts, ttft_baseline_s=tb, ttft_ratio_baseline_over_shared=_ratio(tb, ts),
            same_output_as_baseline=sa[-1].output == ba[-1].output,
        ))
    last = runs[-1][0]
    ps = statistics.median(r[0].prefill_s_spent for r in runs)
    pb = statistics.median(r[1].prefill_s_spent for r in runs)
    rs = statistics.median(r[0].seconds for r in runs)
    rb = statistics.median(r[1].seconds for r in runs)
    return PipelineComparison(
        pipeline=spec.name, agents_count=len(spec.agents), members=sorted({a.model for a in spec.agents}),
        document_tokens=last.document_tokens, repeats=repeats, agents=rows,
        fallbacks=sum(1 for a in last.agents if a.fallback_reason), total_prefill_s_shared=ps,
        total_prefill_s_baseline=pb, prefill_ratio_baseline_over_shared=_ratio(pb, ps), run_s_shared=rs,
        run_s_baseline=rb, run_ratio_baseline_over_shared=_ratio(rb, rs),
        caches=[c.model_dump() for c in last.caches], warnings=list(last.warnings),
    )


def pipeline_markdown(c: PipelineComparison, *, heading: str | None = None) -> list[str]:
    """The per-agent TTFT table and the totals line for one comparison."""
    def fmt(v: float | None) -> str:
        return f"{v:.2f}" if isinstance(v, float) else "-"

    lines = [heading] if heading else []
    lines += ["| agent | model | cache | TTFT shared s | TTFT re-prefill s | ratio | same output |",
              "|---|---|---|---|---|---|---|"]
    for a in c.agents:
        lines.append(f"| {a.agent} | {a.model} | {a.cache_path} | {fmt(a.ttft_shared_s)} | {fmt(a.ttft_baseline_s)} | "
                     f"{fmt(a.ttft_ratio_baseline_over_shared)} | {a.same_output_as_baseline} |")
    lines += ["", f"Document prefill seconds: shared {c.total_prefill_s_shared:.1f}, per-agent "
              f"{c.total_prefill_s_baseline:.1f} (ratio {fmt(c.prefill_ratio_baseline_over_shared)}); "
              f"whole run: {c.run_s_shared:.1f} s vs {c.run_s_baseline:.1f} s "
              f"(ratio {fmt(c.run_ratio_baseline_over_shared)}); gate fallbacks: {c.fallbacks}.", ""]
    return lines


# ----------------------------------------------------------------------------------- N-agent pipelines
class PipelineConfig(_Model):
    agent_counts: list[int] = Field(default_factory=lambda: [2, 4, 8])
    members: list[str] = Field(description="aliases the agents cycle over; the first is the source")
    document_tokens: int = Field(2048, ge=16)
    max_new_tokens: int = Field(16, ge=1)
    repeats: int = Field(1, ge=1)
    gate: dict[str, object] = Field(default_factory=_default_gate)


class PipelineSection(_Model):
    config: PipelineConfig
    runs: list[PipelineComparison] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)


def build_pipeline(n: int, models: dict[str, str], members: list[str], *, max_new_tokens: int,
                   gate: Mapping[str, object] | None = None, name: str | None = None) -> PipelineSpec:
    """``n`` independent agents cycling over ``members`` (summaries and a question, alternately)."""
    from orchestra.pipelines.spec import PipelineSpec

    agents = []
    for i in range(n):
        model = members[i % len(members)]
        if i % 2 == 0:
            agents.append({"name": f"a{i}", "model": model, "builtin": "summarizer",
                           "args": {"max_words": 40, "max_new_tokens": max_new_tokens}})
        else:
            agents.append({"name": f"a{i}", "model": model, "builtin": "question_answerer",
                           "args": {"question": "What does the document allow you to do?",
                                    "max_new_tokens": max_new_tokens}})
    return PipelineSpec.model_validate({
        "name": name or f"bench-{n}-agents", "models": {m: models[m] for m in dict.fromkeys(members)},
        "source": members[0], "agents": agents, "gate": gate if gate is not None else DEFAULT_GATE,
    })


def run_pipeline(config: PipelineConfig, fam: BenchFamily, *, progress: bool = True) -> PipelineSection:
    from tqdm.auto import tqdm

    from orchestra.runs.scheduler import Orchestra

    section = PipelineSection(config=config)
    document = fam.text(config.document_tokens)
    for n in tqdm(config.agent_counts, desc="pipeline", disable=not progress):
        members = config.members[: min(n, len(config.members))]
        spec = build_pipeline(n, fam.aliases, members, max_new_tokens=config.max_new_tokens, gate=config.gate)
        spec = spec.model_copy(update={"default_device": fam.device})
        # models stay loaded across sections: both runs use the bench's registry
        shared = Orchestra(spec, family=fam.family, cache=Orchestra.cache_for(spec, fam.registry, fam.store))
        baseline = Orchestra(spec, family=fam.family, cache=Orchestra.cache_for(spec, fam.registry, fam.store),
                             share_prefill=False)
        section.runs.append(compare_pipeline(shared, baseline, document, repeats=config.repeats))
    return section
