"""``orchestra bench``: mapped caches vs re-prefill on the bundled family, measured in one run.

Sections (each a function taking a typed config and a :class:`BenchFamily`, returning a pydantic
section; add a section by following the same shape and registering it in ``_run.py``):

- ``quality``: every row of :func:`mappings.evaluate.evaluate` per pair and document length;
- ``timing``: target prefill vs map + inject, side by side, and growth with length;
- ``tasks``: QA accuracy of every member on its own prefill, a mapped and a mapped + repaired cache (retention);
- ``pipeline``: N-agent pipelines, prefill once vs per-agent re-prefill;
- ``calibration``: seconds, tokens and artifact bytes of calibrations;
- ``crossfamily``: a model with another tokenizer is refused with a typed error.

Importing this package is cheap: torch and transformers load inside the section functions.
"""

from __future__ import annotations

from orchestra.bench._context import BenchFamily, Pair, parse_pairs
from orchestra.bench._machine import MachineInfo, machine_info
from orchestra.bench._run import SECTIONS, BenchConfig, run_bench
from orchestra.bench.calibration import CalibrationBenchConfig, CalibrationSection, run_calibration
from orchestra.bench.crossfamily import CrossFamilyConfig, CrossFamilySection, run_crossfamily
from orchestra.bench.gate_signals import SIGNALS, GateCandidate, Judged, score_candidates
from orchestra.bench.intervals import paired_ratio_interval, wilson
from orchestra.bench.pipeline import (
    PipelineComparison,
    PipelineConfig,
    PipelineSection,
    compare_pipeline,
    pipeline_markdown,
    run_pipeline,
)
from orchestra.bench.qa import (
    QAQuestion,
    QASet,
    is_correct,
    load_qa,
    normalize,
    passage_window,
    token_offsets,
)
from orchestra.bench.quality import QualityConfig, QualitySection, run_quality
from orchestra.bench.report import BenchResults, render_markdown, write_plots, write_results
from orchestra.bench.tasks import (
    QAAsker,
    TaskConfig,
    TaskSection,
    judged_answers,
    plain_prompt_ids,
    rouge_l,
    run_tasks,
    score_answers,
)
from orchestra.bench.timing import TimingConfig, TimingSection, run_timing

__all__ = [
    "BenchConfig",
    "BenchFamily",
    "BenchResults",
    "Pair",
    "SECTIONS",
    "parse_pairs",
    "run_bench",
    "MachineInfo",
    "machine_info",
    "QualityConfig",
    "QualitySection",
    "run_quality",
    "TimingConfig",
    "TimingSection",
    "run_timing",
    "TaskConfig",
    "TaskSection",
    "run_tasks",
    "rouge_l",
    "QAAsker",
    "plain_prompt_ids",
    "judged_answers",
    "score_answers",
    "wilson",
    "paired_ratio_interval",
    "SIGNALS",
    "GateCandidate",
    "Judged",
    "score_candidates",
    "QAQuestion",
    "QASet",
    "load_qa",
    "normalize",
    "is_correct",
    "passage_window",
    "token_offsets",
    "PipelineConfig",
    "PipelineSection",
    "PipelineComparison",
    "compare_pipeline",
    "run_pipeline",
    "pipeline_markdown",
    "CalibrationBenchConfig",
    "CalibrationSection",
    "run_calibration",
    "CrossFamilyConfig",
    "CrossFamilySection",
    "run_crossfamily",
    "render_markdown",
    "write_plots",
    "write_results",
]
