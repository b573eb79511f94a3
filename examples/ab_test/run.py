"""A/B test: the same questions, answered by every family member, over ONE shared prefill of a document.

    python examples/ab_test/run.py [--document FILE] [--questions Q [Q ...]] [--json OUT]

Two pipeline runs in one process, on the same loaded models:

* **shared** — the document is prefilled once on the root; the root's agents reuse that cache exactly,
  every other member gets it through its calibrated KV mapping (gated; a failed gate re-prefills);
* **baseline** — every agent prefills the document itself (``share_prefill=False``), the usual way.

It prints, per question, each member's answer under both runs side by side (greedy decoding, so a
difference comes from the cache), and what each member's document cache costs: in the shared way
(the root's prefill; a member's map + tail recompute; both the map and a re-prefill when a gate
fell back) against that member's own prefill. The pipelines overlap the members' work, so their
wall times mix members; the table's seconds are therefore timed one FamilyCache request at a time,
alone, in this same process on the same document and models (the pipelines' own wall times are in
the JSON). Nothing is estimated.
Built on the public Python API: `PipelineSpec`s made in Python, `Orchestra.run` (both runs on one
`FamilyCache`, so the models load once) and the cache's leases for the solo timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

HERE = Path(__file__).resolve().parent
DEFAULT_DOCUMENT = HERE.parent / "long_document_analysis" / "document.txt"
DEFAULT_QUESTIONS = (
    "What is this document about? Answer in one sentence.",
    "What must you do when you convey object code of the program?",
)
MEMBERS = ("root", "finetuned", "quantized", "distilled")

__all__ = ["ABResult", "MemberCost", "Answer", "build_pipeline", "run_ab", "render", "main"]


class MemberCost(BaseModel):
    """What giving one member the document's cache costs, the shared way and its own way."""

    member: str
    path: str = Field(description="How the shared run got its cache: exact, mapped or reprefilled (gate fallback).")
    gates: list[str] = Field(default_factory=list, description="Gate decisions of the shared run, e.g. 'pass probe'.")
    fallback_reason: str | None = None
    own_s: float = Field(description="This member's own prefill of the document, timed alone.")
    map_s: float | None = Field(None, description="Mapping the root's cache into it + tail recompute, timed alone.")
    pipeline_shared_s: float = Field(description="Seconds of its cache in the shared pipeline run (overlapping).")
    pipeline_baseline_s: float = Field(description="Seconds of its agents' prefills in the baseline run (overlapping).")

    @property
    def shared_s(self) -> float:
        """The shared way: the source prefills; a mapped member maps; a fallback pays the map and a prefill."""
        if self.path == "exact" or self.map_s is None:
            return self.own_s
        return self.map_s + (self.own_s if self.path == "reprefilled" else 0.0)

    @property
    def ratio(self) -> float:
        return self.shared_s / self.own_s if self.own_s > 0 else float("nan")


class Answer(BaseModel):
    question: str
    member: str
    path: str
    shared: str
    baseline: str

    @property
    def identical(self) -> bool:
        return self.shared.strip() == self.baseline.strip()


class ABResult(BaseModel):
    document: str
    document_tokens: int
    source: str = "root"
    questions: list[str]
    costs: list[MemberCost]
    answers: list[Answer]
    failures: list[str] = Field(default_factory=list, description="Agents that failed in either run.")

    @property
    def shared_total_s(self) -> float:
        return sum(c.shared_s for c in self.costs)

    @property
    def baseline_total_s(self) -> float:
        return sum(c.own_s for c in self.costs)

    def summary(self) -> dict[str, Any]:
        saved = self.baseline_total_s - self.shared_total_s
        return {"shared_total_s": self.shared_total_s, "baseline_total_s": self.baseline_total_s,
                "saved_s": saved, "shared_over_baseline": self.shared_total_s / self.baseline_total_s
                if self.baseline_total_s > 0 else None,
                "identical_answers": sum(a.identical for a in self.answers), "answers": len(self.answers)}


def _agent_name(member: str, index: int) -> str:
    return f"{member}_q{index + 1}"


def build_pipeline(members: list[str], questions: list[str], *, max_new_tokens: int = 32,
                   offline_max_kl: float = 0.15, device: str = "auto", name: str = "ab-test"):
    """One `question_answerer` agent per (member, question), all over the same document."""
    from orchestra import AgentNode, PipelineSpec

    agents = [
        AgentNode(name=_agent_name(member, i), model=member, builtin="question_answerer",
                  args={"question": question, "max_new_tokens": max_new_tokens})
        for member in members for i, question in enumerate(questions)
    ]
    return PipelineSpec(name=name, models={m: m for m in members}, source="root", default_device=device,
                        agents=agents, gate={"offline": {"max_kl": offline_max_kl}, "probe": {"tokens": 32}})


def _solo_costs(orch, members: list[str], document: str) -> dict[str, tuple[float, float | None]]:
    """Per member, (own prefill seconds, map + tail recompute seconds), each one FamilyCache request timed alone.

    The same work the pipeline's cache does, one request at a time on an otherwise idle process,
    after a short warm-up per model so one-off start-up costs stay out of both sides: a prefill
    that keeps nothing (the root's is kept: the maps start from it), then the root's cache mapped
    across with the gates off (the cost of a map is the point here; the shared run shows the gates'
    verdicts). The cache is emptied afterwards, so the runs start cold.
    """
    from agents import DocumentPrompt
    from orchestra import GatePolicy

    cache = orch.cache
    ids = DocumentPrompt(document).token_ids(orch.registry.load("root").tokenizer)
    ungated = GatePolicy(offline=None, probe=None)
    costs: dict[str, tuple[float, float | None]] = {}
    leases = []
    for member in ["root", *[m for m in members if m != "root"]]:
        cache.acquire_sync(member, list(range(100, 132)), reuse=False).release()  # warm-up
        own = cache.acquire_sync(member, ids, reuse=member == "root")
        leases.append(own)
        if member == "root":
            costs[member] = (own.prefill_seconds, None)
            continue
        mapped = cache.acquire_sync(member, ids, gate=ungated)
        leases.append(mapped)
        costs[member] = (own.prefill_seconds, mapped.map_seconds if mapped.path == "mapped" else None)
    for lease in leases:
        lease.release()
    cache.clear()
    return costs


async def run_ab(document: str, questions: list[str], *, members: list[str] | None = None, max_new_tokens: int = 32,
                 offline_max_kl: float = 0.15, device: str = "auto", family: Any | None = None,
                 document_name: str = "document") -> ABResult:
    """Run the shared and the baseline pipeline over ``document`` and compare them."""
    import anyio

    from orchestra import Orchestra

    members = list(members or MEMBERS)
    if "root" not in members:
        members.insert(0, "root")  # the source: it prefills the document in both runs
    if family is None:
        from orchestra import load_family

        family = load_family()
    shared_spec = build_pipeline(members, questions, max_new_tokens=max_new_tokens, offline_max_kl=offline_max_kl,
                                 device=device)
    base_spec = build_pipeline(members, questions, max_new_tokens=max_new_tokens, device=device,
                               name="ab-test-baseline")
    shared = Orchestra(shared_spec, family=family)
    # the same FamilyCache (same loaded models: the timings compare like with like), used without sharing
    baseline = Orchestra(base_spec, family=family, cache=shared.cache, share_prefill=False)
    solo = await anyio.to_thread.run_sync(_solo_costs, shared, members, document)

    report = await shared.run(document)
    base = await baseline.run(document)

    costs = []
    for member in members:
        mine = [c for c in report.caches if c.model == member]
        theirs = [c for c in base.caches if c.model == member]
        agents = [a for a in report.agents if a.model == member]
        first = agents[0]
        costs.append(MemberCost(
            member=member, path=first.cache_path or "-",
            gates=[("pass " if g["passed"] else "FAIL ") + g["gate"] for g in first.gate],
            fallback_reason=first.fallback_reason, own_s=solo[member][0], map_s=solo[member][1],
            # a fallback's cache holds the mapping attempt and the re-prefill: both count
            pipeline_shared_s=sum(c.seconds for c in mine), pipeline_baseline_s=sum(c.seconds for c in theirs),
        ))
    answers, failures = [], []
    for member in members:
        for i, question in enumerate(questions):
            name = _agent_name(member, i)
            a, b = report.agent(name), base.agent(name)
            failures += [f"{r.pipeline}:{name}: {r.agent(name).error_type}: {r.agent(name).error}"
                         for r in (report, base) if r.agent(name).status != "succeeded"]
            answers.append(Answer(question=question, member=member, path=a.cache_path or "-",
                                  shared=a.output or f"[{a.status}: {a.error_type}]",
                                  baseline=b.output or f"[{b.status}: {b.error_type}]"))
    return ABResult(document=document_name, document_tokens=report.document_tokens, questions=list(questions),
                    costs=costs, answers=answers, failures=failures)


def render(result: ABResult, console=None) -> None:
    """Print the side-by-side answer tables and the cost table."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for i, question in enumerate(result.questions):
        table = Table(title=f"Q{i + 1}: {question}", show_lines=True)
        for col in ("member", "cache", "answer over the shared prefill", "answer over its own prefill", "same"):
            table.add_column(col, overflow="fold")
        for a in result.answers:
            if a.question == question:
                table.add_row(a.member, a.path, a.shared.strip(), a.baseline.strip(), "yes" if a.identical else "no")
        console.print(table)
    table = Table(title=f"document cache cost per member ({result.document}, {result.document_tokens} tokens)")
    for col in ("member", "shared run", "gates", "map s", "shared s", "own prefill s", "shared / own"):
        table.add_column(col, justify="left" if col in {"member", "shared run", "gates"} else "right")
    for c in result.costs:
        table.add_row(c.member, c.path, ", ".join(c.gates) or "-", "-" if c.map_s is None else f"{c.map_s:.3f}",
                      f"{c.shared_s:.3f}", f"{c.own_s:.3f}", f"{c.ratio:.2f}")
    s = result.summary()
    table.add_row("total", "", "", "", f"{s['shared_total_s']:.3f}", f"{s['baseline_total_s']:.3f}",
                  f"{s['shared_over_baseline']:.2f}" if s["shared_over_baseline"] is not None else "-")
    console.print(table)
    console.print(f"prefill seconds saved: {s['saved_s']:.3f} of {s['baseline_total_s']:.3f} (the shared way costs "
                  f"{s['shared_over_baseline']:.2f}x one prefill per member); identical answers: "
                  f"{s['identical_answers']}/{s['answers']}", highlight=False)
    for c in result.costs:
        if c.fallback_reason:
            console.print(f"{c.member}: fell back to a re-prefill: {c.fallback_reason}", highlight=False)
    for failure in result.failures:
        console.print(f"[red]failed[/] {failure}", highlight=False)


def main(argv: list[str] | None = None) -> ABResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--document", type=Path, default=DEFAULT_DOCUMENT, help="UTF-8 text file (default: the GPL-3 "
                        "sections of examples/long_document_analysis)")
    parser.add_argument("--questions", nargs="+", default=list(DEFAULT_QUESTIONS), help="questions to ask every member")
    parser.add_argument("--members", nargs="+", default=list(MEMBERS), choices=MEMBERS,
                        help="family members to compare (root is always included: it is the source)")
    parser.add_argument("--max-chars", type=int, default=None, help="use only the first N characters of the document")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--offline-max-kl", type=float, default=0.15,
                        help="offline gate threshold on the mapping's held-out KL (library default 0.1)")
    parser.add_argument("--device", default="auto", help="cpu, cuda:N or auto")
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)

    import anyio

    if not args.document.is_file():
        parser.error(f"document {args.document} does not exist")
    text = args.document.read_text(encoding="utf-8")
    if args.max_chars:
        text = text[: args.max_chars]
    result = anyio.run(lambda: run_ab(text, args.questions, members=args.members, max_new_tokens=args.max_new_tokens,
                                      offline_max_kl=args.offline_max_kl, device=args.device,
                                      document_name=args.document.name))
    render(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {**result.model_dump(mode="json"), "summary": result.summary(),
                   "shared_s": {c.member: c.shared_s for c in result.costs},
                   "ratios": {c.member: c.ratio for c in result.costs}}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))  # run from anywhere in a source checkout
    main()
