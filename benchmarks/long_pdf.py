"""A PDF several times the bundled model's context, analysed end to end by the long demo's pipeline.

    python benchmarks/long_pdf.py [--pdf PATH] [--via api|cli]

The PDF is made from examples/long_document_analysis/licences.md (four licences, each from a new page,
headings in bold) with fpdf2 (the `dev` extra), so its text comes back through pypdf with `[page N]`
anchors. It is then read by examples/long_document_analysis/long.yaml on the bundled family: through the
Python API (`Pipeline.from_file(...).run_sync(Path(pdf))`, the default) or through `orchestra run
--document PDF --report FILE` (`--via cli`). The result says, per chunk, its pages, tokens and the cache
path each member got, how many times the source prefilled it (from the run's cache-step events: once
each is the point), and every agent's status.

Writes results/long_pdf_{api,cli}.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXAMPLE = ROOT / "examples" / "long_document_analysis"


def make_pdf(markdown: Path, out: Path) -> int:
    """`markdown` as a PDF (a `#` heading starts a page, headings bold); written to a temporary sibling and
    renamed into place. Returns its page count."""
    from fpdf import FPDF

    pdf = FPDF(format="A4")
    pdf.set_auto_page_break(auto=True, margin=15)
    pdf.set_margins(18, 15, 18)
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            pdf.set_font("Helvetica", size=10)
            pdf.multi_cell(0, 4.6, " ".join(paragraph), new_x="LMARGIN", new_y="NEXT")
            pdf.ln(1.6)
            paragraph.clear()

    for line in markdown.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if text.startswith("#"):
            flush()
            level = len(text) - len(text.lstrip("#"))
            if level == 1:
                pdf.add_page()
            pdf.set_font("Helvetica", style="B", size=15 if level == 1 else 12)
            pdf.multi_cell(0, 7, text.lstrip("#").strip(), new_x="LMARGIN", new_y="NEXT")
            pdf.ln(1)
        elif not text:
            flush()
        else:
            if pdf.page == 0:
                pdf.add_page()
            paragraph.append(text)
    flush()
    from mappings.atomic import write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, bytes(pdf.output()))
    return pdf.page


def _summary(report: Any, prefills: Counter[int], wall: float, pdf: Path, pages: int, via: str,
             command: str, rc: int | None = None) -> dict[str, Any]:
    from orchestra.documents.formats import load_document
    from orchestra.family.manifest import load_family
    from orchestra.models.registry import ModelRegistry

    text = load_document(pdf).text
    context = ModelRegistry({"root": "root"}, family=load_family(None)).info("root").max_positions
    return {
        "command": command, "via": via, "pdf": str(pdf.relative_to(ROOT)) if pdf.is_relative_to(ROOT) else pdf.name,
        "pdf_bytes": pdf.stat().st_size, "pages": pages, "text_characters": len(text),
        "document_tokens": sum(c.tokens for c in report.chunks), "context_tokens": context,
        "times_context": round(sum(c.tokens for c in report.chunks) / context, 2),
        "chunks": [{"index": c.index, "anchor": c.anchor, "tokens": c.tokens, "paths": c.paths,
                    "source_prefills": prefills.get(c.index, 0)} for c in report.chunks],
        "every_chunk_prefilled_once": all(prefills.get(c.index, 0) == 1 for c in report.chunks),
        "agents": [{"name": a.name, "model": a.model, "status": a.status, "calls": len(a.chunks),
                    "cache_path": a.cache_path, "output_head": (a.output or "")[:300]} for a in report.agents],
        "all_succeeded": all(a.status == "succeeded" for a in report.agents),
        "exit_code": rc, "wall_s": round(wall, 1),
    }


def via_api(pdf: Path) -> tuple[Any, Counter[int], float, str]:
    from orchestra import Pipeline
    from orchestra.observability.events import CacheStepEvent

    pipeline = Pipeline.from_file(EXAMPLE / "long.yaml")
    prefills: Counter[int] = Counter()
    source = "root"

    def on_event(event: object) -> None:
        if isinstance(event, CacheStepEvent) and event.chunk is not None and event.step.step == "prefill" \
                and event.step.member == source:
            prefills[event.chunk] += 1

    t0 = time.perf_counter()
    report = pipeline.run_sync(pdf, on_event=on_event)
    return report, prefills, time.perf_counter() - t0, 'Pipeline.from_file("long.yaml").run_sync(Path(pdf))'


def via_cli(pdf: Path, out: Path) -> tuple[Any, Counter[int], float, str, int]:
    from orchestra import RunReport

    report_path = out / "long_pdf_cli.report.json"
    command = ["orchestra", "run", str(EXAMPLE / "long.yaml"), "--document", str(pdf), "--report", str(report_path),
               "--jsonl"]
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, check=False, stdout=subprocess.PIPE, text=True)
    wall, rc = time.perf_counter() - t0, done.returncode
    report = RunReport.model_validate_json(report_path.read_text())
    report_path.unlink()
    prefills: Counter[int] = Counter()
    for line in done.stdout.splitlines():
        event = json.loads(line)
        step = event.get("step") or {}
        if event.get("kind") == "cache_step" and event.get("chunk") is not None and step.get("step") == "prefill" \
                and step.get("member") == "root":
            prefills[event["chunk"]] += 1
    shown = " ".join(command).replace(str(ROOT) + "/", "").replace(str(pdf), "licences.pdf")
    return report, prefills, wall, shown, rc


def markdown(result: dict[str, Any]) -> str:
    lines = ["# A PDF several times the context, end to end", "",
             f"Command: `python benchmarks/long_pdf.py --via {result['via']}` (runs `{result['command']}`)", "",
             f"The PDF: {result['pages']} pages, {result['pdf_bytes']:,} bytes, made from licences.md by fpdf2 and read "
             f"back by pypdf: {result['text_characters']:,} characters, {result['document_tokens']:,} tokens over its "
             f"chunks ({result['times_context']}x the bundled model's {result['context_tokens']:,}-token context).", "",
             f"Every chunk prefilled once on the source: **{result['every_chunk_prefilled_once']}**; every agent "
             f"succeeded: **{result['all_succeeded']}**"
             + (f" (exit code {result['exit_code']})" if result["exit_code"] is not None else "")
             + f"; wall {result['wall_s']} s on this machine.", "",
             "| chunk | starts at | tokens | source prefills | cache path per member |", "|---|---|---|---|---|"]
    for c in result["chunks"]:
        paths = ", ".join(f"{m}: {p}" for m, p in sorted(c["paths"].items()))
        lines.append(f"| {c['index'] + 1} | {c['anchor'] or '-'} | {c['tokens']} | {c['source_prefills']} | {paths} |")
    lines += ["", "| agent | model | status | calls | costliest cache path | output (head) |", "|---|---|---|---|---|---|"]
    for a in result["agents"]:
        head = a["output_head"].replace("\n", " ").replace("|", "/")[:160]
        lines.append(f"| {a['name']} | {a['model']} | {a['status']} | {a['calls']} | {a['cache_path']} | {head} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pdf", type=Path, help="where to write the PDF (default: a temporary folder)")
    parser.add_argument("--via", choices=("api", "cli"), default="api")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    from mappings.atomic import write_atomic

    work = Path(tempfile.mkdtemp(prefix="long_pdf_"))
    pdf = args.pdf or work / "licences.pdf"
    pages = make_pdf(EXAMPLE / "licences.md", pdf)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.via == "api":
        report, prefills, wall, command = via_api(pdf)
        result = _summary(report, prefills, wall, pdf, pages, "api", command)
    else:
        report, prefills, wall, command, rc = via_cli(pdf, args.out)
        result = _summary(report, prefills, wall, pdf, pages, "cli", command, rc)
    name = f"long_pdf_{args.via}"
    write_atomic(args.out / f"{name}.json", json.dumps(result, indent=2))
    write_atomic(args.out / f"{name}.md", markdown(result))
    print(markdown(result))
    return 0 if result["every_chunk_prefilled_once"] and result["all_succeeded"] else 1


if __name__ == "__main__":
    sys.exit(main())
