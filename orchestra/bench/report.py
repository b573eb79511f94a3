"""Results on disk: ``bench.json`` (one pydantic model), ``bench.md`` (tables) and PNG plots."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from orchestra.bench._machine import MachineInfo
from orchestra.bench.calibration import CalibrationSection
from orchestra.bench.crossfamily import CrossFamilySection
from orchestra.bench.pipeline import PipelineSection, pipeline_markdown
from orchestra.bench.quality import QualitySection
from orchestra.bench.repair import RepairSection, repair_markdown
from orchestra.bench.tasks import TaskSection, tasks_markdown
from orchestra.bench.timing import TimingSection

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from orchestra.bench.repair import RepairPoint

__all__ = ["BenchResults", "write_results", "result_paths", "render_markdown", "write_plots", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2  # 2: the tasks section is the QA accuracy table


class BenchResults(BaseModel):
    """Everything one ``orchestra bench`` run measured; each section is None when not run."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    created_at: str
    command: str = Field(description="the exact command line")
    machine: MachineInfo
    config: dict[str, object] = Field(description="the run's BenchConfig")
    seconds: float = Field(description="wall seconds of the whole run")
    section_seconds: dict[str, float] = Field(default_factory=dict)
    calibrated: list[dict[str, object]] = Field(default_factory=list, description="mappings calibrated into the store by this run")
    quality: QualitySection | None = None
    timing: TimingSection | None = None
    tasks: TaskSection | None = None
    pipeline: PipelineSection | None = None
    calibration: CalibrationSection | None = None
    crossfamily: CrossFamilySection | None = None
    repair: RepairSection | None = None
    plots: list[str] = Field(default_factory=list, description="PNG files, relative to the output folder")


def _f(v: float | None, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _skipped(items: list[str]) -> list[str]:
    """A blank line, then one bullet per skipped item (and a closing blank line when there are any)."""
    return [""] + [f"- skipped: {s}" for s in items] + ([""] if items else [])


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def render_markdown(r: BenchResults) -> str:
    """The whole of ``bench.md``: the run's header, then a section per measured part, then the plots."""
    lines = _header_markdown(r)
    if r.quality is not None:
        lines += _quality_markdown(r.quality)
    if r.repair is not None:
        lines += repair_markdown(r.repair)
    if r.timing is not None:
        lines += _timing_markdown(r.timing)
    if r.tasks is not None:
        lines += tasks_markdown(r.tasks)
    if r.pipeline is not None:
        lines += _pipeline_section_markdown(r.pipeline)
    if r.calibration is not None:
        lines += _calibration_markdown(r.calibration)
    if r.crossfamily is not None:
        lines += _crossfamily_markdown(r.crossfamily)
    if r.plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in r.plots] + [""]
    return "\n".join(lines)


def _header_markdown(r: BenchResults) -> list[str]:
    """The title, command, machine and run time, and the mappings this run calibrated into the store."""
    m = r.machine
    lines = [
        "# orchestra bench", "",
        f"Command: `{r.command}`", "",
        f"Machine: {m.cpu_model}, {m.cpu_count} logical CPUs ({m.torch_threads} torch threads), "
        f"device {m.device}; "
        f"Python {m.python}, torch {m.torch}, transformers {m.transformers}; {m.platform}.", "",
        f"Run: {r.created_at}, {r.seconds:.0f} s in all (" + ", ".join(
            f"{k} {v:.0f} s" for k, v in r.section_seconds.items()) + ").", "",
    ]
    for c in r.calibrated:
        lines.append(f"- Calibrated into the store by this run: {c['pair']} ({c['tokens']} tokens, "
                     f"{c['seconds']:.0f} s).")
    if r.calibrated:
        lines.append("")
    return lines


def _pipeline_section_markdown(p: PipelineSection) -> list[str]:
    """The pipeline section: shared prefill vs per-agent re-prefill per agent count, then each run's table."""
    lines = [
        "## Pipeline: prefill once vs per-agent re-prefill", "",
        f"N independent agents cycling over {', '.join(p.config.members)} (source {p.config.members[0]}), "
        f"{p.config.max_new_tokens} new tokens each, the example pipeline's gates; median of "
        f"{p.config.repeats} repeat(s), both modes in one process.", "",
        "| agents | members | doc tokens | prefill s shared | prefill s re-prefill | prefill ratio | "
        "run s shared | run s re-prefill | run ratio | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in p.runs:
        lines.append(f"| {run.agents_count} | {len(run.members)} | {run.document_tokens} | "
                     f"{run.total_prefill_s_shared:.2f} | {run.total_prefill_s_baseline:.2f} | "
                     f"{_f(run.prefill_ratio_baseline_over_shared, 2)} | {run.run_s_shared:.2f} | "
                     f"{run.run_s_baseline:.2f} | {_f(run.run_ratio_baseline_over_shared, 2)} | "
                     f"{run.fallbacks} |")
    for run in p.runs:
        lines += [""] + pipeline_markdown(run, heading=f"### {run.agents_count} agents\n")
        lines += [f"- fallback {a.agent}: {a.fallback_reason}" for a in run.agents if a.fallback_reason]
    return lines + [""]


def _calibration_markdown(cal: CalibrationSection) -> list[str]:
    """The calibration cost table: time, tokens, held-out KL and artifact sizes per pair."""
    lines = [
        "## Calibration cost", "",
        "| pair | origin | method | seconds | tokens | held-out KL | map | stats | map / model | "
        "all artifacts / model |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cr in cal.rows:
        lines.append(f"| {cr.pair} | {cr.origin} | {cr.method} | {cr.seconds:.1f} | {cr.tokens} | "
                     f"{_f(cr.heldout_kl)} | {_bytes(cr.map_bytes)} | {_bytes(cr.stats_bytes)} | "
                     f"{cr.map_fraction_of_model:.2%} | {cr.artifact_fraction_of_model:.2%} |")
    return lines + _skipped(cal.skipped)


def _crossfamily_markdown(xf: CrossFamilySection) -> list[str]:
    """The cross-family refusals: one row per check, its message cut to 220 characters."""
    lines = ["## Cross-family pair (must be refused)", "", f"Foreign model: {xf.foreign_model}.", "",
             "| check | refused | error | message |", "|---|---|---|---|"]
    for f in xf.refusals:
        msg = f.message.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {f.check} | {f.refused} | {f.error_type or '-'} | "
                     f"{msg[:220]}{'…' if len(msg) > 220 else ''} |")
    return lines + [""]


def _quality_markdown(q: QualitySection) -> list[str]:
    methods = q.methods()
    lines = [
        "## Quality: next-token KL vs the target's own prefill", "",
        f"Held-out document {q.document} ({q.document_tokens} tokens), suffix {q.config.suffix_tokens} tokens, "
        f"up to {q.config.windows} window(s). KL in nats (lower is better; re-prefill is the truth, 0).", "",
        "| pair | length | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    keys = list(dict.fromkeys((x.pair, x.length) for x in q.rows))
    for pair, n in keys:
        cells = []
        for meth in methods:
            try:
                cells.append(_f(q.row(pair, n, meth).kl))
            except KeyError:
                cells.append("-")
        lines.append(f"| {pair} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "### All quality rows", "",
              "| pair | length | method | KL | top-1 | top-5 | NLL Δ | greedy agree | map s | prefill s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for x in q.rows:
        greedy = "-" if x.greedy_agreement is None else f"{x.greedy_agreement:.1f}/{x.greedy_tokens}"
        lines.append(f"| {x.pair} | {x.length} | {x.method} | {_f(x.kl)} | {_f(x.top1, 3)} | {_f(x.top5, 3)} | "
                     f"{'-' if x.nll_delta is None else f'{x.nll_delta:+.4f}'} | {greedy} | {_f(x.map_seconds)} | "
                     f"{_f(x.prefill_seconds, 3)} |")
    if q.curves:
        lines += ["", "### Error accumulation (KL with target layers 0..k mapped)", "",
                  "| pair | length | method | layers | KL after first quarter | half | all |", "|---|---|---|---|---|---|---|"]
        for curve in q.curves:
            k = len(curve.kl)
            lines.append(f"| {curve.pair} | {curve.length} | {curve.method} | {k} | {_f(curve.kl[max(0, k // 4 - 1)])} | "
                         f"{_f(curve.kl[max(0, k // 2 - 1)])} | {_f(curve.kl[-1])} |")
    lines += _skipped(q.skipped)
    return lines


def _timing_markdown(t: TimingSection) -> list[str]:
    lines = [
        "## Cost: target prefill vs map + inject", "",
        f"Medians of {t.config.repeats} side-by-side repetitions; speed-up = median over repetitions of "
        f"prefill / map. 'map + tail' adds the scheduler's recompute of the last {t.config.tail_tokens} tokens. "
        "The source prefill is paid once per document whatever the number of targets.", "",
        "| pair | length | target prefill s | map + inject s | speed-up | map + tail s | speed-up with tail | source prefill s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tr in t.rows:
        wrapped = " (repeated text)" if tr.wrapped else ""
        lines.append(f"| {tr.pair} | {tr.length}{wrapped} | {_f(tr.target_prefill_median_s, 3)} | {_f(tr.map_median_s)} | "
                     f"{tr.speedup:.1f}x | {_f(tr.map_tail_median_s, 3)} | {tr.speedup_with_tail:.1f}x | "
                     f"{_f(tr.source_prefill_median_s, 3)} |")
    lines += ["", "Growth with length (seconds ∝ length^exponent, log-log fit):", "",
              "| pair | quantity | exponent | × per doubling | lengths |", "|---|---|---|---|---|"]
    for g in t.growth:
        lines.append(f"| {g.pair} | {g.quantity} | {_f(g.exponent, 2)} | {_f(g.per_doubling, 2)} | "
                     f"{', '.join(map(str, g.lengths))} |")
    lines += _skipped(t.skipped)
    return lines


def write_plots(r: BenchResults, out: Path) -> list[str]:
    """PNG plots next to the results; returns their names relative to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = [
        ("bench_quality_vs_layers.png", _plot_quality_vs_layers),
        ("bench_cost_vs_length.png", _plot_cost_vs_length),
        ("bench_kl_by_method.png", _plot_kl_by_method),
        ("bench_repair_curve.png", _plot_repair_curve),
    ]
    names: list[str] = []
    for name, plot in plots:
        fig = plot(plt, r)
        if fig is not None:
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            names.append(name)
    return names


def _plot_quality_vs_layers(plt: ModuleType, r: BenchResults) -> Figure | None:
    q = r.quality
    if q is None or not q.curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for c in q.curves:
        ax.plot([layer + 1 for layer in c.layers], c.kl, marker="o", ms=3, label=f"{c.pair} ({c.method})")
    ax.set_xlabel("target layers mapped (0..k)")
    ax.set_ylabel("next-token KL vs re-prefill (nats)")
    ax.set_title(f"Quality vs layers mapped ({q.curves[0].length}-token prefix)")
    ax.legend(fontsize=8)
    return fig


def _plot_cost_vs_length(plt: ModuleType, r: BenchResults) -> Figure | None:
    t = r.timing
    if t is None or not t.rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for pair in dict.fromkeys(x.pair for x in t.rows):
        trows = sorted((x for x in t.rows if x.pair == pair), key=lambda x: x.length)
        xs = [x.length for x in trows]
        line = ax.plot(xs, [x.target_prefill_median_s for x in trows], marker="o", label=f"{pair}: target prefill")
        ax.plot(xs, [x.map_median_s for x in trows], marker="s", ls="--", color=line[0].get_color(),
                label=f"{pair}: map + inject")
        ax.plot(xs, [x.map_tail_median_s for x in trows], marker="^", ls=":", color=line[0].get_color(),
                label=f"{pair}: map + tail")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("document tokens")
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"Cost vs document length ({r.machine.device})")
    ax.legend(fontsize=7, ncol=2)
    return fig


def _plot_kl_by_method(plt: ModuleType, r: BenchResults) -> Figure | None:
    q = r.quality
    if q is None or not q.rows:
        return None
    n = q.curves[0].length if q.curves else q.rows[0].length
    rows = [x for x in q.rows if x.length == n and x.method != "reprefill"]
    pairs = list(dict.fromkeys(x.pair for x in rows))
    methods = list(dict.fromkeys(x.method for x in rows))
    if not (pairs and methods):
        return None
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(pairs) * max(1, len(methods)) / 3), 4.2))
    width = 0.8 / len(methods)
    for j, meth in enumerate(methods):
        ys = []
        for pair in pairs:
            hit = [x.kl for x in rows if x.pair == pair and x.method == meth]
            ys.append(hit[0] if hit else float("nan"))
        ax.bar([i + j * width for i in range(len(pairs))], ys, width, label=meth)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(pairs))], pairs, rotation=15)
    ax.set_yscale("log")
    ax.set_ylabel("next-token KL vs re-prefill (nats, log)")
    ax.set_title(f"KL per pair and method ({n}-token prefix)")
    ax.legend(fontsize=7, ncol=3)
    return fig


def _plot_repair_curve(plt: ModuleType, r: BenchResults) -> Figure | None:
    rp = r.repair
    if rp is None or not rp.points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for pair in dict.fromkeys(x.pair for x in rp.points):
        pts = sorted((x for x in rp.points if x.pair == pair and "," not in x.label and x.label != "reprefill"),
                     key=lambda x: x.planned_cost)
        line = ax.plot([_spent(x) for x in pts], [max(x.kl, 1e-5) for x in pts], marker="o",
                       label=f"{pair}: map + token repair")
        extra = [x for x in rp.points if x.pair == pair and "," in x.label]
        for x in extra:
            ax.scatter([_spent(x)], [max(x.kl, 1e-5)], marker="x" if ",L" in x.label else "^",
                       color=line[0].get_color())
            ax.annotate(x.label.split(",", 1)[1], (_spent(x), max(x.kl, 1e-5)), fontsize=7)
    ax.axvline(0.15, color="grey", ls=":", lw=1)
    ax.axhline(0.005, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured map + repair seconds (fraction of the target's own prefill)")
    ax.set_ylabel("next-token KL vs re-prefill (nats)")
    ax.set_title(f"Map, then repair ({rp.config.length}-token prefix)")
    ax.legend(fontsize=7)
    return fig


def _spent(point: RepairPoint) -> float:
    """A repair point's x on the log-scale curve: map, repair and the rest of the repair call, over the prefill."""
    return max(point.map_share + point.measured_cost + point.other_share, 1e-3)


def result_paths(out: str | Path) -> tuple[Path, Path]:
    """Where results go: ``<out>/bench.json`` and ``bench.md`` for a folder, or ``<x>.json`` and ``<x>.md``
    for ``out = <x>.json`` (so a one-section run can be kept beside the full one without overwriting it)."""
    out = Path(out)
    if out.suffix == ".json":
        return out, out.with_suffix(".md")
    return out / "bench.json", out / "bench.md"


def write_results(r: BenchResults, out: str | Path, *, plots: bool = True) -> BenchResults:
    """Write plots, the JSON and the Markdown (see :func:`result_paths`); returns the results with plot names."""
    json_path, md_path = result_paths(out)
    folder = json_path.parent
    folder.mkdir(parents=True, exist_ok=True)
    if plots:
        r = r.model_copy(update={"plots": write_plots(r, folder)})
    from mappings.atomic import write_atomic

    write_atomic(json_path, r.model_dump_json(indent=2) + "\n")  # temporary siblings, then renames
    write_atomic(md_path, render_markdown(r))
    return r
