"""The whole benchmark: resolve the configuration (quick or full), run the sections, write the results."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestra.bench._context import FORWARD_PAIRS, REVERSE_PAIRS, BenchFamily, Pair, parse_pairs

__all__ = ["BenchConfig", "SECTIONS", "run_bench"]

SECTIONS = ("crossfamily", "quality", "repair", "timing", "tasks", "pipeline", "calibration")
FULL_LENGTHS = (512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (512, 1024)


class BenchConfig(BaseModel):
    """What to measure. ``None`` fields take the quick or the full default (see :meth:`resolved`)."""

    model_config = ConfigDict(extra="forbid")
    quick: bool = False
    pairs: list[str] | None = Field(None, description="SOURCE>TARGET aliases; default forward pairs + reverse(s)")
    lengths: list[int] | None = Field(None, description="document lengths in tokens")
    sections: list[str] = Field(default_factory=lambda: list(SECTIONS))
    repeats: int | None = Field(None, ge=1, description="timing repetitions (median)")
    windows: int | None = Field(None, ge=1, description="quality windows per length (where the document allows)")
    suffix_tokens: int = Field(32, ge=1)
    greedy_tokens: int | None = Field(None, ge=0)
    tail_tokens: int = Field(32, ge=0)
    task_pairs: list[str] | None = Field(None, description="SOURCE>TARGET pairs of the task section (default: the "
                                         "first pair's source into every other family member)")
    task_tokens: int | None = Field(None, ge=16, description="document tokens of each QA window")
    task_max_new_tokens: int | None = Field(None, ge=1, description="tokens each QA answer may generate")
    qa_lengths: list[int] | None = Field(None, description="window lengths of the source's QA accuracy sweep")
    qa_limit: int | None = Field(None, ge=1, description="ask only the first N questions of the QA set")
    qa_questions: list[str] | None = Field(None, description="ask only these question ids")
    qa_file: str | None = Field(None, description="a QA set (JSON, the bundled one's format) instead of the bundled one, "
                                   "or a bundled set's bare name ('qa_heldout.json')")
    qa_repair_budget: float | None = Field(None, gt=0.0, le=1.0, description="repair budget of the mapped+repair "
                                           "condition (None: the question answerer's own `mapped_repair`)")
    qa_repair_focus: Literal["tail", "question"] = Field(
        "tail", description="what ranks the interior tokens the mapped+repair condition recomputes: the document's "
        "last tokens, or each question (a repaired cache per question)")
    pipeline_agents: list[int] | None = None
    pipeline_tokens: int | None = Field(None, ge=16)
    pipeline_max_new_tokens: int | None = Field(None, ge=1)
    pipeline_repeats: int = Field(1, ge=1)
    calibration_tokens: int | None = Field(None, ge=16, description="fitting tokens of the timed calibration")
    calibration_window: int | None = Field(None, ge=8)
    repair_length: int | None = Field(None, ge=16, description="prefix tokens of the repair curve")
    repair_budgets: list[float] | None = Field(None, description="repair budgets (fractions of a prefill)")
    repair_costs: Literal["measured", "compute"] = Field(
        "measured", description="how repair budgets are priced: the target's timed passes on this machine, or "
        "multiply-adds (the repair curve and the tasks' mapped+repair condition)")
    device: str = "cpu"

    @field_validator("sections")
    @classmethod
    def _known_sections(cls, value: list[str]) -> list[str]:
        unknown = [s for s in value if s not in SECTIONS]
        if unknown:
            raise ValueError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
        return [s for s in SECTIONS if s in value]  # fixed order: cheap refusal first, calibration last

    def resolved(self) -> BenchConfig:
        """Every ``None`` filled with the quick or full default."""
        q = self.quick
        pairs = self.pairs or (list(FORWARD_PAIRS) + ([REVERSE_PAIRS[0]] if q else list(REVERSE_PAIRS)))
        forward = [p for p in pairs if p.split(">")[0].strip() == pairs[0].split(">")[0].strip()]
        # tasks: explicit pairs, else forward pairs when --pairs was given, else (None) every member of the family
        task_pairs = self.task_pairs or ((forward[:1] if q else forward) if self.pairs else None)
        return self.model_copy(update={
            "pairs": pairs,
            "lengths": self.lengths or list(QUICK_LENGTHS if q else FULL_LENGTHS),
            "repeats": self.repeats or 3,
            "windows": self.windows or (1 if q else 2),
            "greedy_tokens": self.greedy_tokens if self.greedy_tokens is not None else (16 if q else 32),
            "task_pairs": task_pairs,
            "task_tokens": self.task_tokens or 512,
            "task_max_new_tokens": self.task_max_new_tokens or 24,
            "qa_lengths": self.qa_lengths if self.qa_lengths is not None else [],
            "qa_limit": self.qa_limit or (12 if q else None),
            "pipeline_agents": self.pipeline_agents or ([2] if q else [2, 4, 8]),
            "pipeline_tokens": self.pipeline_tokens or (1024 if q else 2048),
            "pipeline_max_new_tokens": self.pipeline_max_new_tokens or (8 if q else 24),
            "calibration_tokens": self.calibration_tokens or (1024 if q else 4096),
            "calibration_window": self.calibration_window or (256 if q else 512),
            "repair_length": self.repair_length or (1024 if q else 4096),
            "repair_budgets": self.repair_budgets or ([0.05, 0.15] if q else [0.02, 0.05, 0.1, 0.15, 0.25, 0.5]),
        })


def run_bench(
    config: BenchConfig,
    out: str | Path,
    *,
    family: BenchFamily | None = None,
    home: str | Path | None = None,
    command: str = "orchestra bench",
    progress: bool = True,
    log: Callable[[str], object] | None = None,
):
    """Run the configured sections on ``family`` (default: the bundled one) and write the results to ``out``."""
    from orchestra.bench._machine import machine_info
    from orchestra.bench.report import BenchResults, write_results

    say = log or (lambda _msg: None)
    cfg = config.resolved()
    started = time.perf_counter()
    fam = family or BenchFamily.bundled(home, device=cfg.device)
    pairs: list[Pair] = parse_pairs(cfg.pairs or [])
    named = pairs + (parse_pairs(cfg.task_pairs or []) if "tasks" in cfg.sections else [])
    unknown = sorted({a for p in named for a in (p.source, p.target)} - set(fam.aliases))
    if unknown:
        raise ValueError(f"unknown model alias(es) {', '.join(unknown)}; known: {', '.join(fam.aliases)}")
    lengths = sorted(set(cfg.lengths or []))
    results: dict[str, BaseModel] = {}
    seconds: dict[str, float] = {}
    for name in cfg.sections:
        say(f"[bold]section {name}[/]")
        t0 = time.perf_counter()
        section = _run_section(name, cfg, pairs, lengths, fam, progress)
        if section is not None:
            results[name] = section
        seconds[name] = time.perf_counter() - t0
    bench = BenchResults(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), command=command,
        machine=machine_info(cfg.device), config=cfg.model_dump(mode="json"),
        seconds=time.perf_counter() - started, section_seconds=seconds,
        calibrated=[c.model_dump() for c in fam.calibrated], **results,
    )
    return write_results(bench, out)


def _run_section(name: str, cfg: BenchConfig, pairs: list[Pair], lengths: list[int], fam: BenchFamily,
                 progress: bool) -> BaseModel | None:
    """One section's results, its config drawn from the resolved run config (None for an unknown name)."""
    from orchestra.bench.calibration import CalibrationBenchConfig, run_calibration
    from orchestra.bench.crossfamily import CrossFamilyConfig, run_crossfamily
    from orchestra.bench.pipeline import PipelineConfig, run_pipeline
    from orchestra.bench.quality import QualityConfig, run_quality
    from orchestra.bench.repair import RepairConfig, run_repair
    from orchestra.bench.tasks import TaskConfig, run_tasks
    from orchestra.bench.timing import TimingConfig, run_timing

    if name == "crossfamily":
        return run_crossfamily(CrossFamilyConfig(source=pairs[0].source if pairs else next(iter(fam.aliases))),
                               fam, progress=progress)
    if name == "quality":
        return run_quality(QualityConfig(
            pairs=pairs, lengths=lengths, suffix_tokens=cfg.suffix_tokens, windows=cfg.windows or 1,
            tail_tokens=cfg.tail_tokens, greedy_tokens=cfg.greedy_tokens or 0), fam, progress=progress)
    if name == "repair":
        forward = [p for p in pairs if p.source == pairs[0].source] if pairs else []
        return run_repair(RepairConfig(
            pairs=forward, length=cfg.repair_length or 1024, suffix_tokens=cfg.suffix_tokens,
            windows=cfg.windows or 1, budgets=cfg.repair_budgets or [0.05, 0.15], costs=cfg.repair_costs), fam,
            progress=progress)
    if name == "timing":
        return run_timing(TimingConfig(pairs=pairs, lengths=lengths, repeats=cfg.repeats or 3,
                                       tail_tokens=cfg.tail_tokens), fam, progress=progress)
    if name == "tasks":
        task_pairs = parse_pairs(cfg.task_pairs or [])
        source = task_pairs[0].source if task_pairs else (pairs[0].source if pairs else next(iter(fam.aliases)))
        targets = ([p.target for p in task_pairs if p.source == source] if task_pairs
                   else [a for a in fam.aliases if a != source])
        return run_tasks(TaskConfig(
            source=source, members=targets, window_tokens=cfg.task_tokens or 512,
            max_new_tokens=cfg.task_max_new_tokens or 24, tail_tokens=max(2, cfg.tail_tokens),
            repair_budget=cfg.qa_repair_budget, repair_focus=cfg.qa_repair_focus, repair_costs=cfg.repair_costs,
            questions=cfg.qa_questions,
            limit=cfg.qa_limit,
            qa_file=cfg.qa_file, lengths=cfg.qa_lengths or []),
            fam, progress=progress)
    if name == "pipeline":
        members = list(dict.fromkeys([pairs[0].source, *fam.aliases])) if pairs else list(fam.aliases)
        return run_pipeline(PipelineConfig(
            agent_counts=cfg.pipeline_agents or [2], members=members, document_tokens=cfg.pipeline_tokens or 1024,
            max_new_tokens=cfg.pipeline_max_new_tokens or 8, repeats=cfg.pipeline_repeats), fam, progress=progress)
    if name == "calibration":
        return run_calibration(CalibrationBenchConfig(
            pairs=pairs, timed_pair=pairs[0] if pairs else None, tokens=cfg.calibration_tokens or 1024,
            window=cfg.calibration_window or 256), fam, progress=progress)
    return None
