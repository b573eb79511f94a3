"""A document several times the model's context, chunked: what prefilling each chunk once saves, what a
map-reduce summary of it takes, and what answering over retrieved chunks costs in accuracy.

    python benchmarks/long_document.py [--window 2048] [--questions 24] [--document PATH ...]
                                       [--skip-cost] [--skip-summary] [--skip-qa]

The document (by default) is examples/long_document_analysis/licences.md (GPL-3, Apache-2.0, MPL-2.0,
GFDL-1.3 under Markdown headings, ~18,900 tokens) followed by more_licences.md beside it (the other licence
texts a Debian machine ships in /usr/share/common-licenses, Python's and NumPy's licences: ~48,000 tokens):
~66,900 tokens of text (71,700 prefix tokens once cut, with each chunk's overlap and prompt frame), 8.8x the
bundled family's 8,192-token context, cut into `--window`-token chunks on its structure (`orchestra.documents.chunking`). `--document` reads other files instead (joined in the order given).

- *cost*: three agents on three members (root, finetuned, int8), each over every chunk, run twice on fresh
  caches: prefill once (each chunk prefilled on the root, mapped into the other two behind the gates) and
  per-agent re-prefill (every agent prefills every chunk on its own member, `share_prefill=False`). Prefill
  tokens computed, prefill seconds, maps, wall seconds, and the ratio.
- *summary*: the built-in `summarizer` over every chunk on the root (map) and the built-in `report_writer`
  over its notes (reduce, in rounds when the notes outgrow a window): calls, rounds, wall seconds and the
  summary itself.
- *qa*: the bundled QA set's questions on these licences, asked of the root by the `question_answerer`
  built-in over the whole long document (the 2 chunks most relevant to the question by BM25, `chunks: 2`)
  and over the one chunk holding the answer's passage (the oracle: what retrieval could at best reach).
  Correct = a reference answer occurs in what the agent returned (normalised).

Writes results/long_document.json and .md. The disk tier is off (every number is this process's compute).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["ORCHESTRA_KV_STORE"] = "off"
DOCUMENTS = (ROOT / "examples" / "long_document_analysis" / "licences.md",
             ROOT / "examples" / "long_document_analysis" / "more_licences.md")
MEMBERS = ("root", "finetuned", "int8")
SUMMARY_WORDS = 30
"""The map summaries' length asked of the summarizer."""


def _spec(chunking: dict[str, Any], agents: list[dict[str, Any]], inputs: list[str] | None = None) -> Any:
    from orchestra import PipelineSpec

    return PipelineSpec.model_validate({
        "name": "long-document-bench", "models": {m: m for m in MEMBERS}, "source": "root",
        "chunking": chunking, "agents": agents, "inputs": inputs or [],
        "gate": {"offline": {"max_kl": 0.1}, "probe": {"tokens": 32, "max_excess_nll": 0.25, "max_excess_kl": 0.1}},
        "mapping": {"on_missing": "refuse"}})


def _run(orch: Any, document: str, **kwargs: Any) -> Any:
    """One run of `orch` (an `Orchestra`, whose `run` is async) from this synchronous script."""
    import functools

    import anyio

    return anyio.run(functools.partial(orch.run, document, **kwargs))


def cost(manifest: Any, document: str, window: int, share: bool) -> dict[str, Any]:
    """The three-agent run on fresh caches; what it computed."""
    from orchestra import Orchestra

    agents = [{"name": f"notes_{m}", "model": m, "per_chunk": True,
               "spec": {"task": "Name the licence this part of the document belongs to.",
                        "generation": {"max_new_tokens": 8}}} for m in MEMBERS]
    orch = Orchestra(_spec({"mode": "always", "window_tokens": window}, agents), family=manifest, share_prefill=share)
    for m in MEMBERS:
        orch.cache.executor.model(m)  # weights loaded outside the timing
    t0 = time.perf_counter()
    report = _run(orch, document)
    wall = time.perf_counter() - t0
    calls = [c for a in report.agents for c in a.chunks]
    computed = sum(c.prefix_tokens for c in calls if c.cache_path in ("exact", "reprefilled") and c.prefill_s_spent > 0)
    if share:
        computed = sum(ch.tokens for ch in report.chunks) + sum(
            c.prefix_tokens for c in calls if c.cache_path == "reprefilled")
    paths: dict[str, int] = {}
    for a in report.agents:
        for c in a.chunks:
            key = f"{a.model}:{c.cache_path}"
            paths[key] = paths.get(key, 0) + 1
    out = {"share_prefill": share, "chunks": len(report.chunks), "document_tokens": sum(ch.tokens for ch in report.chunks),
           "agents": {a.name: a.status for a in report.agents}, "calls": len(calls), "paths": paths,
           "prefill_tokens_computed": computed, "prefill_s": report.prefill_s_spent, "wall_s": wall,
           "prefill_s_every_chunk_estimate": report.prefill_s_every_chunk,
           "maps": sum(1 for c in calls if c.cache_path == "mapped")}
    orch.close()
    return out


def summary(manifest: Any, document: str, window: int) -> dict[str, Any]:
    """The built-in summarizer over every chunk (map), reduced by the built-in report writer, on fresh caches."""
    from orchestra import Orchestra

    agents = [{"name": "summary", "model": "root", "builtin": "summarizer",
               "args": {"max_words": SUMMARY_WORDS, "max_new_tokens": 48}},
              {"name": "overall", "model": "root", "builtin": "report_writer", "upstream": ["summary"],
               "args": {"upstream": ["summary"], "max_new_tokens": 160}}]
    orch = Orchestra(_spec({"mode": "always", "window_tokens": window}, agents), family=manifest)
    orch.cache.executor.model("root")
    t0 = time.perf_counter()
    report = _run(orch, document)
    wall = time.perf_counter() - t0
    orch.close()
    mapped, reduced = report.agent("summary"), report.agent("overall")
    return {"chunks": len(report.chunks), "document_tokens": sum(ch.tokens for ch in report.chunks),
            "agents": {a.name: a.status for a in report.agents}, "map_calls": len(mapped.chunks),
            "map_degenerate": sum(1 for c in mapped.chunks if c.degenerate_reason),
            # a reduce whose notes fit one window is one call over them (no chunk calls listed)
            "reduce_calls": len(reduced.chunks) or 1, "reduce_rounds": max((c.round for c in reduced.chunks), default=1),
            "map_tokens": sum(c.tokens for c in mapped.chunks), "prefill_s": report.prefill_s_spent, "wall_s": wall,
            "map_generation_s": mapped.generation_s, "reduce_generation_s": reduced.generation_s,
            "summary": reduced.output}


def _asker_task() -> dict[str, Any]:
    """question_answerer's own role and task, its question read from the run's `question` input."""
    from agents import BUILTINS

    spec = BUILTINS["question_answerer"](question="QQQ", max_new_tokens=48)
    return {"role": spec.role, "task": spec.task.replace("QQQ", "{question}"),
            "generation": spec.generation.model_dump()}


def qa(manifest: Any, document: str, window: int, limit: int) -> dict[str, Any]:
    from orchestra import Orchestra
    from orchestra.bench import is_correct, load_qa

    agent = {"name": "answer", "model": "root", "chunks": 2, "query": "{question}", "spec": _asker_task()}
    long_run = Orchestra(_spec({"mode": "always", "window_tokens": window}, [agent], ["question"]), family=manifest)
    oracle = Orchestra(_spec({"mode": "never"}, [{**agent, "chunks": "all"}], ["question"]), cache=long_run.cache)
    qaset = load_qa()
    rows: list[dict[str, Any]] = []
    for q in qaset.questions:
        passage = " ".join(qaset.passage_text(q.passage).split())
        if len(rows) >= limit:
            break
        t0 = time.perf_counter()
        report = _run(long_run, document, inputs={"question": q.question})
        long_s = time.perf_counter() - t0
        flat = [(ch, " ".join(document[ch.start:ch.end].split())) for ch in report.chunks]
        holding = [ch for ch, text in flat if passage in text]
        if not holding:  # the passage straddles two chunks: no one chunk holds it
            continue
        chunk = holding[0]
        answer = report.agent("answer")
        asked = [c.index for c in answer.chunks]
        best = _run(oracle, document[chunk.start:chunk.end], inputs={"question": q.question}).agent("answer")
        rows.append({"question": q.id, "answers": q.answers, "chunk": chunk.index, "retrieved": asked,
                     "retrieved_right_chunk": any(h.index in asked for h in holding),
                     "long": answer.output, "long_correct": answer.status == "succeeded" and is_correct(
                         answer.output or "", q.answers),
                     "oracle": best.output, "oracle_correct": best.status == "succeeded" and is_correct(
                         best.output or "", q.answers), "long_s": long_s})
    long_run.close()
    n = len(rows)
    return {"n": n, "long_correct": sum(r["long_correct"] for r in rows),
            "oracle_correct": sum(r["oracle_correct"] for r in rows),
            "retrieval_hits": sum(r["retrieved_right_chunk"] for r in rows), "rows": rows}


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    sized = result.get("summary") or (result.get("cost") or {}).get("once")
    size = (f", {sized['document_tokens']:,} tokens over its {sized['chunks']} chunks "
            f"({sized['document_tokens'] / result['context_tokens']:.1f}x the model's {result['context_tokens']:,}-token "
            "context)") if sized else ""
    files = " + ".join(f"`{d}`" for d in result["document"])
    lines = ["# A document several times the context, chunked (bundled SmolLM2 family, CPU)", "",
             f"Command: `{result['command']}`. Machine: {m['cpu']} CPUs, torch {m['torch']}. Document: {files}, "
             f"{result['document_chars']:,} characters{size}; chunks of {result['window']:,} tokens.", ""]
    if result.get("cost"):
        once, each = result["cost"]["once"], result["cost"]["per_agent"]
        lines += ["## Prefill once vs per-agent re-prefill", "",
                  f"Three agents (on root, finetuned and int8), each over all {once['chunks']} chunks "
                  f"({once['document_tokens']:,} prefix tokens in all), on fresh caches.", "",
                  "| run | prefill tokens computed | prefill s | maps | cache paths (calls) | wall s | agents |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in (("prefill once", once), ("per-agent re-prefill", each)):
            paths = ", ".join(f"{k} {v}" for k, v in sorted(r["paths"].items()))
            agents = ", ".join(f"{k} {v}" for k, v in r["agents"].items())
            lines.append(f"| {name} | {r['prefill_tokens_computed']:,} | {r['prefill_s']:.1f} | {r['maps']} | {paths} | "
                         f"{r['wall_s']:.1f} | {agents} |")
        lines += ["", f"**Prefill tokens: {each['prefill_tokens_computed'] / max(1, once['prefill_tokens_computed']):.2f}x "
                  f"fewer; prefill seconds {each['prefill_s'] / max(1e-9, once['prefill_s']):.2f}x fewer; wall "
                  f"{each['wall_s'] / max(1e-9, once['wall_s']):.2f}x faster** with each chunk prefilled once.", ""]
    if result.get("summary"):
        r = result["summary"]
        agents = ", ".join(f"{k} {v}" for k, v in r["agents"].items())
        lines += ["## A map-reduce summary of the whole document", "",
                  f"The built-in `summarizer` over every chunk on the root (map, {SUMMARY_WORDS} words each), then the built-in "
                  "`report_writer` over its notes (reduce), on fresh caches.", "",
                  "| chunks | map calls | left out as degenerate | reduce calls | reduce rounds | prefill s | "
                  "map generation s | reduce generation s | wall s | agents |",
                  "|---|---|---|---|---|---|---|---|---|---|",
                  f"| {r['chunks']} | {r['map_calls']} | {r['map_degenerate']} | {r['reduce_calls']} | "
                  f"{r['reduce_rounds']} | {r['prefill_s']:.1f} | {_num(r['map_generation_s'])} | "
                  f"{_num(r['reduce_generation_s'])} | {r['wall_s']:.1f} | {agents} |", "",
                  "The summary (a 135M model's):", "", *(f"> {line}" for line in (r["summary"] or "").splitlines()), ""]
    if result.get("qa"):
        q = result["qa"]
        lines += ["## Answering over the long document vs over the chunk that holds the answer", "",
                  f"{q['n']} questions of the bundled QA set (those whose passage lies inside one chunk), "
                  "`question_answerer` on root, greedy.", "",
                  "| asked over | correct | accuracy |", "|---|---|---|",
                  f"| the whole document, the 2 chunks BM25 ranks first | {q['long_correct']}/{q['n']} | "
                  f"{q['long_correct'] / max(1, q['n']):.0%} |",
                  f"| the one chunk holding the answer (oracle) | {q['oracle_correct']}/{q['n']} | "
                  f"{q['oracle_correct'] / max(1, q['n']):.0%} |", "",
                  f"BM25 put the answer's chunk among the 2 asked for {q['retrieval_hits']}/{q['n']} questions.", ""]
    return "\n".join(lines)


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def context_tokens(manifest: Any) -> int:
    """The root's context (what 'times the context' is measured against), as the registry reads its config."""
    from orchestra.models.registry import ModelRegistry

    return ModelRegistry({"root": "root"}, family=manifest).info("root").max_positions


def main() -> None:
    import json

    import torch

    from mappings.atomic import write_atomic
    from orchestra.family.manifest import load_family

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-summary", action="store_true")
    parser.add_argument("--skip-qa", action="store_true")
    parser.add_argument("--document", type=Path, nargs="+", default=list(DOCUMENTS),
                        help="files read as the document, joined by a blank line (default: the two licence files)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    manifest = load_family(None)
    document = "\n\n".join(p.read_text(encoding="utf-8").strip("\n") for p in args.document)
    result: dict[str, Any] = {
        "command": "python benchmarks/long_document.py " + " ".join(sys.argv[1:]), "window": args.window,
        "document": [_shown(p) for p in args.document], "document_chars": len(document),
        "context_tokens": context_tokens(manifest), "machine": {"cpu": os.cpu_count(), "torch": torch.__version__}}
    if not args.skip_cost:
        result["cost"] = {"once": cost(manifest, document, args.window, True),
                          "per_agent": cost(manifest, document, args.window, False)}
        print(json.dumps(result["cost"], indent=1), flush=True)
    if not args.skip_summary:
        result["summary"] = summary(manifest, document, args.window)
        print(json.dumps(result["summary"], indent=1), flush=True)
    if not args.skip_qa:
        result["qa"] = qa(manifest, document, args.window, args.questions)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "long_document.json", json.dumps(result, indent=2, default=str) + "\n")
    write_atomic(args.out / "long_document.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
