"""Prefill-once pipeline vs the same pipeline with per-agent re-prefill, measured in one process.

    python benchmarks/pipeline_ttft.py [--pipeline FILE] [--document FILE] [--repeats N]

A thin wrapper over :func:`orchestra.bench.pipeline.compare_pipeline` (also behind the pipeline
section of ``orchestra bench``): runs the pipeline twice per repeat on fresh KV stores, shared
(one source prefill, mapped or exact caches elsewhere, gates on) and baseline (every agent
prefills the document itself), with mappings already calibrated (the first, untimed warm-up run
calibrates any that are missing). Writes benchmarks/results/pipeline_ttft.json and .md with
per-agent time to first token and their ratios, medians over the repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from orchestra.bench import compare_pipeline, machine_info, pipeline_markdown
    from orchestra.family import load_family
    from orchestra.pipelines.spec import load_pipeline
    from orchestra.runs.scheduler import Orchestra

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", type=Path, default=ROOT / "examples/long_document_analysis/pipeline.yaml")
    parser.add_argument("--document", type=Path, default=ROOT / "examples/long_document_analysis/document.txt")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = parser.parse_args()

    family = load_family()
    spec = load_pipeline(args.pipeline)
    document = args.document.read_text(encoding="utf-8")
    shared = Orchestra(spec, family=family)
    # the baseline uses the same loaded models, through a cache of its own that shares nothing
    baseline = Orchestra(spec, family=family, cache=Orchestra.cache_for(spec, shared.registry, shared.mappings),
                         share_prefill=False)
    comparison = compare_pipeline(shared, baseline, document, repeats=args.repeats)

    machine = machine_info()
    pipeline = args.pipeline.resolve()
    result = {
        "command": "python benchmarks/pipeline_ttft.py " + " ".join(sys.argv[1:]),
        "machine": machine.model_dump(),
        "pipeline": str(pipeline.relative_to(ROOT)) if pipeline.is_relative_to(ROOT) else str(pipeline),
        **comparison.model_dump(exclude={"pipeline"}),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_ttft.json").write_text(__import__("json").dumps(result, indent=2))
    lines = [
        f"# Prefill once vs per-agent re-prefill ({comparison.document_tokens} document tokens, {machine.device})",
        "", f"Command: `{result['command']}`; median of {args.repeats} repeat(s), both modes in one process. "
        f"Machine: {machine.cpu_model}, {machine.cpu_count} CPUs, torch {machine.torch}.", "",
        *pipeline_markdown(comparison),
    ]
    (args.out / "pipeline_ttft.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
