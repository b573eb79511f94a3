"""Repair: the quality/cost curve from a pure map to a full re-prefill, per pair.

Each point is one :class:`mappings.repair.RepairPolicy` scored by :func:`mappings.evaluate.evaluate`
on the held-out document: next-token KL and top-1 against the target's own prefill, the planned
cost (the repair's multiply-adds counting attention over the prefill's: what the budget bounds,
:func:`mappings.repair.compute_share`), the token share (recomputed tokens / prefix + recomputed
layers / layers) and the measured cost (the repair's target seconds over the target's own prefill
seconds in the same window, as ``orchestra evaluate`` measures it), with the map's seconds and the
rest of the repair call (the source ranking scattered tokens) reported beside it. The curve starts
at the pure map (budget 0) and ends at re-prefill (cost 1, KL 0). Variants that spend part
of the budget on layer blocks (needs residual maps) or on attention-picked interior tokens are
scored at one budget, next to the token-only point with the same budget.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestra.bench._context import BenchFamily, Pair

__all__ = ["RepairConfig", "RepairPoint", "RepairSection", "run_repair", "repair_markdown", "DEFAULT_BUDGETS"]

DEFAULT_BUDGETS = (0.02, 0.05, 0.1, 0.15, 0.25, 0.5)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RepairConfig(_Model):
    pairs: list[Pair]
    length: int = Field(4096, ge=16, description="prefix (cached) tokens")
    suffix_tokens: int = Field(32, ge=1)
    windows: int = Field(2, ge=1)
    budgets: list[float] = Field(default_factory=lambda: list(DEFAULT_BUDGETS))
    variant_budget: float = Field(0.15, description="budget at which layer / scattered variants are scored")
    layer_share: float = Field(0.5, description="share of the variant budget spent on layer blocks")
    scattered_share: float = Field(0.25, description="share of the variant's token budget on attention-picked tokens")
    costs: Literal["measured", "compute"] = Field(
        "measured", description="how budgets are priced: the target's timed passes on this machine, or multiply-adds")


class RepairPoint(_Model):
    """One policy on one pair."""

    pair: str
    label: str = Field(description="map, repair@B%[,L..][,S..] or reprefill")
    budget: float
    kl: float
    top1: float
    top5: float
    planned_cost: float = Field(description="the plan's predicted cost / the prefill's (0 for the map), in the "
                                "section's `costs` measure: what the budget bounds")
    measured_cost: float = Field(description="the repair's target seconds / target prefill seconds, same windows "
                                 "(0 for the map, 1 for reprefill): the number to hold against planned_cost")
    token_share: float | None = Field(None, description="recomputed tokens / prefix + recomputed layers / layers")
    map_share: float = Field(0.0, description="map seconds / target prefill seconds (paid once, before any repair)")
    other_share: float = Field(0.0, description="the repair call's seconds outside the target's passes (the source "
                               "ranking scattered tokens, planning) / target prefill seconds")
    tokens: int = 0
    blocks: list[list[int]] = Field(default_factory=list)


class RepairSection(_Model):
    config: RepairConfig
    document: str
    points: list[RepairPoint] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)

    def best_within(self, pair: str, cost: float) -> RepairPoint | None:
        """The lowest-KL point of ``pair`` whose planned and measured costs are both at most ``cost``."""
        fits = [p for p in self.points if p.pair == pair and p.label != "reprefill"
                and p.planned_cost <= cost + 1e-9 and p.measured_cost <= cost + 1e-9]
        return min(fits, key=lambda p: p.kl) if fits else None


def run_repair(config: RepairConfig, fam: BenchFamily, *, progress: bool = True) -> RepairSection:
    from tqdm.auto import tqdm

    from mappings.evaluate import evaluate
    from mappings.repair import RepairPolicy

    ids = fam.document_ids()
    section = RepairSection(config=config, document=fam.document_name)
    n, m = config.length, config.suffix_tokens
    windows = min(config.windows, (len(ids) - 1) // (n + m))
    if windows < 1:
        section.skipped.append(f"{fam.document_name} has {len(ids)} tokens, fewer than prefix {n} + suffix {m}")
        return section
    for pair in tqdm(config.pairs, desc="repair", disable=not progress):
        mapping = fam.mapping(pair)
        policies = [RepairPolicy(budget=b) for b in config.budgets]
        vb = config.variant_budget
        if mapping.residual is not None:
            policies.append(RepairPolicy(budget=vb, layer_share=config.layer_share))
        else:
            section.skipped.append(f"{pair.label}: layer variant skipped, the mapping has no residual maps "
                                   "(`orchestra family calibrate --repair`)")
        policies.append(RepairPolicy(budget=vb, scattered_share=config.scattered_share))
        report = evaluate(mapping, ids, source=fam.handle(pair.source), target=fam.handle(pair.target),
                          prefix_tokens=n, suffix_tokens=m, windows=windows, tail_tokens=0, greedy_tokens=0,
                          baselines=(), layer_curves=False, repairs=policies, document_name=fam.document_name,
                          device=fam.device, repair_costs=config.costs)
        ref = report.reference_prefill_seconds
        own = report.mapping_method
        for r in report.methods:
            if r.method == "reprefill":
                label, budget = "reprefill", 1.0
            elif r.method == own:
                label, budget = "map", 0.0
            elif r.method.startswith(f"{own}+repair@"):
                label = r.method[len(own) + 1 :]
                budget = float(r.repair["policy"]["budget"]) if r.repair else 0.0
            else:
                continue
            reprefill = label == "reprefill"
            measured = 1.0 if reprefill else (r.measured_cost if r.measured_cost is not None else
                                              r.prefill_seconds / ref)
            section.points.append(RepairPoint(
                pair=pair.label, label=label, budget=budget, kl=r.kl, top1=r.top1, top5=r.top5,
                planned_cost=r.cost_fraction if r.cost_fraction is not None else budget, measured_cost=measured,
                token_share=r.token_share, map_share=0.0 if reprefill else r.map_seconds / ref,
                other_share=0.0 if reprefill else max(0.0, r.prefill_seconds / ref - measured),
                tokens=int(r.repair["tokens"]) if r.repair else 0,
                blocks=list(r.repair["blocks"]) if r.repair else [],
            ))
    return section


def repair_markdown(section: RepairSection) -> list[str]:
    c = section.config
    lines = [
        "## Map, then repair: quality vs cost", "",
        f"Held-out {section.document}, prefix {c.length} tokens, suffix {c.suffix_tokens}, {c.windows} window(s). "
        "Costs are fractions of the target's own prefill of the prefix. Planned = the repair's predicted cost, "
        + ("the target's passes priced by its timed pass costs on this machine (`mappings.passcost`: a fixed cost "
           "per pass, per token, per key scored, per cached position a pass holds, per position copied)" if c.costs == "measured" else
           "its multiply-adds counting attention (a trailing token scores ~n keys, an average prefill token n / 2)")
        + ": what the budget bounds; token share = recomputed tokens / prefix + recomputed layers / layers; measured = the repair's "
        "target seconds / the target's own prefill seconds in the same windows, each the fastest of 2 runs. Map = the map's seconds, other = "
        "the rest of the repair call (the source ranking scattered tokens), both over the same prefill. `L` = "
        "share of the budget on layer blocks recomputed from residual-mapped hidden states; `S` = share of the "
        "token budget on interior tokens the source attends to most.", "",
        f"| pair | policy | KL | top-1 | top-5 | planned ({c.costs}) | token share | measured | measured / planned "
        "| map | other | tokens | layer blocks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in section.points:
        blocks = ", ".join(f"{a}-{z - 1}" for a, z in p.blocks) or "-"
        ratio = f"{p.measured_cost / p.planned_cost:.2f}x" if p.planned_cost > 0 else "-"
        share = "-" if p.token_share is None else f"{p.token_share:.1%}"
        lines.append(f"| {p.pair} | {p.label} | {p.kl:.4f} | {p.top1:.3f} | {p.top5:.3f} | {p.planned_cost:.1%} | "
                     f"{share} | {p.measured_cost:.1%} | {ratio} | {p.map_share:.1%} | {p.other_share:.1%} | "
                     f"{p.tokens} | {blocks} |")
    pairs = list(dict.fromkeys(p.pair for p in section.points))
    if pairs:
        lines += ["", "Best point within 15 % of a re-prefill (planned and measured):", ""]
        for pair in pairs:
            best = section.best_within(pair, 0.15)
            if best is not None:
                lines.append(f"- {pair}: {best.label}, KL {best.kl:.4f}, top-1 {best.top1:.3f}, "
                             f"planned cost {best.planned_cost:.1%}, measured {best.measured_cost:.1%}")
    for s in section.skipped:
        lines.append(f"- skipped: {s}")
    lines.append("")
    return lines
