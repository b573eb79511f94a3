"""Prefill-once pipeline vs the same pipeline with per-agent re-prefill, measured in one process.

    python benchmarks/pipeline_ttft.py [--pipeline FILE] [--document FILE] [--repeats N]

Runs the pipeline twice per repeat on fresh KV stores: shared (one source prefill, mapped or
exact caches elsewhere, gates on) and baseline (every agent prefills the document itself), with
mappings already calibrated (the first, untimed warm-up run calibrates any that are missing).
Writes benchmarks/results/pipeline_ttft.json and .md with per-agent time to first token and
their ratios, medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _machine() -> dict[str, str]:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"python": platform.python_version(), "torch": torch.__version__, "device": device,
            "cpu_count": str(__import__("os").cpu_count()), "platform": platform.platform()}


def main() -> None:
    from orchestra.family import load_family
    from orchestra.kvstore import KVStore
    from orchestra.pipeline import load_pipeline
    from orchestra.scheduler import Orchestra

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
    baseline = Orchestra(spec, family=family, mappings=shared.mappings, share_prefill=False)
    baseline.registry = shared.registry  # the same loaded models for both
    anyio.run(shared.run, document)  # warm-up: loads models, calibrates missing mappings

    runs = []
    for _ in range(args.repeats):
        shared.store = KVStore(spec.store_budget_mb << 20)
        a = anyio.run(shared.run, document)
        b = anyio.run(baseline.run, document)
        runs.append((a, b))

    agents = []
    for agent in spec.agents:
        s = [r[0].agent(agent.name) for r in runs]
        b = [r[1].agent(agent.name) for r in runs]
        ttft_s = statistics.median(x.ttft_s for x in s if x.ttft_s is not None) if all(x.ttft_s for x in s) else None
        ttft_b = statistics.median(x.ttft_s for x in b if x.ttft_s is not None) if all(x.ttft_s for x in b) else None
        agents.append({
            "agent": agent.name, "model": agent.model, "cache_path": s[-1].cache_path,
            "fallback_reason": s[-1].fallback_reason, "ttft_shared_s": ttft_s, "ttft_baseline_s": ttft_b,
            "ttft_ratio_baseline_over_shared": (ttft_b / ttft_s) if ttft_s and ttft_b else None,
            "same_output_as_baseline": s[-1].output == b[-1].output,
        })
    last_shared, last_base = runs[-1]
    result = {
        "command": "python benchmarks/pipeline_ttft.py " + " ".join(sys.argv[1:]),
        "machine": _machine(), "pipeline": str(args.pipeline.relative_to(ROOT)), "document_tokens": last_shared.document_tokens,
        "repeats": args.repeats, "agents": agents,
        "total_prefill_s_shared": statistics.median(r[0].prefill_s_spent for r in runs),
        "total_prefill_s_baseline": statistics.median(r[1].prefill_s_spent for r in runs),
        "run_s_shared": statistics.median(r[0].seconds for r in runs),
        "run_s_baseline": statistics.median(r[1].seconds for r in runs),
        "caches": [c.model_dump() for c in last_shared.caches],
    }
    result["prefill_ratio_baseline_over_shared"] = result["total_prefill_s_baseline"] / result["total_prefill_s_shared"]
    result["run_ratio_baseline_over_shared"] = result["run_s_baseline"] / result["run_s_shared"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_ttft.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Prefill once vs per-agent re-prefill ({result['document_tokens']} document tokens, {result['machine']['device']})",
        "", f"Command: `{result['command']}`; median of {args.repeats} repeat(s), both modes in one process.", "",
        "| agent | model | cache | TTFT shared s | TTFT re-prefill s | ratio | same output |", "|---|---|---|---|---|---|---|",
    ]
    for a in agents:
        fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else "-"  # noqa: E731
        lines.append(f"| {a['agent']} | {a['model']} | {a['cache_path']} | {fmt(a['ttft_shared_s'])} | "
                     f"{fmt(a['ttft_baseline_s'])} | {fmt(a['ttft_ratio_baseline_over_shared'])} | {a['same_output_as_baseline']} |")
    lines += ["", f"Document prefill seconds: shared {result['total_prefill_s_shared']:.1f}, per-agent "
              f"{result['total_prefill_s_baseline']:.1f} (ratio {result['prefill_ratio_baseline_over_shared']:.2f}); "
              f"whole run: {result['run_s_shared']:.1f} s vs {result['run_s_baseline']:.1f} s "
              f"(ratio {result['run_ratio_baseline_over_shared']:.2f}).", ""]
    (args.out / "pipeline_ttft.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
