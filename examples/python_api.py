"""The smallest useful program on orchestra's Python API: a two-agent pipeline on two family members.

    export ORCHESTRA_HOME=~/.cache/orchestra   # where `orchestra family build` (or `orchestra demo`) put it
    python examples/python_api.py [--document FILE] [--max-new-tokens N]

The root summarizes the document; the fine-tuned member reviews that summary. The document is
prefilled once, on the root; the fine-tuned member runs on the root's KV cache mapped into it
(or on its own re-prefill, if the quality gate says no: the report tells you which).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from orchestra import Pipeline

if TYPE_CHECKING:
    from orchestra import RunReport

DOCUMENT = Path(__file__).resolve().parent / "long_document_analysis" / "document.txt"


def build(max_new_tokens: int = 64) -> Pipeline:
    # Every family role (root, finetuned, quantized, distilled) is already a model alias; `models` adds one.
    return (
        Pipeline("python-api", source="root", models={"tuned": "finetuned"})
        .agent("summarizer", model="root", name="summary", max_words=60, max_new_tokens=max_new_tokens)
        # the critic's template reads {summary}, so `summary` is its upstream without saying so
        .agent("critic", model="tuned", name="review", target_agent="summary", max_new_tokens=max_new_tokens)
    )


def run(document: str, max_new_tokens: int = 64) -> RunReport:
    return build(max_new_tokens).run_sync(document)  # in async code: `await pipeline.run(document)`


def main(argv: list[str] | None = None) -> RunReport:
    parser = argparse.ArgumentParser(description="Two agents on two family members over one prefill.")
    parser.add_argument("--document", type=Path, default=DOCUMENT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    report = run(args.document.read_text(encoding="utf-8"), args.max_new_tokens)
    for agent in report.agents:
        print(f"== {agent.name} on {agent.model} ({agent.status}, cache: {agent.cache_path})")
        print(agent.output if agent.status == "succeeded" else agent.error or agent.skip_reason)
    for cache in report.caches:
        print(f"cache {cache.model}: {cache.path} in {cache.seconds:.2f}s")
    print(f"document {report.document_tokens} tokens; prefill seconds spent {report.prefill_s_spent:.2f}, "
          f"saved {report.prefill_s_saved:.2f}; run {report.seconds:.1f}s")
    return report


if __name__ == "__main__":
    main()
