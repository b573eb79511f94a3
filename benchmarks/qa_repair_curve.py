"""How much repair a mapped cache needs before the question answerer answers as well as on its own prefill.

    python benchmarks/qa_repair_curve.py [--settings pure,r10s,...] [--limit N]

The bundled QA set (60 extractive questions over the licences, `orchestra bench --sections tasks`), each asked
over a 512-token window around its passage by the built-in `question_answerer` on the fine-tuned member, on the
root's cache mapped into it (gates open, as the tasks bench's `mapped`), under each repair setting: the pure map
with a 32- or 128-token recomputed tail, and repair budgets (a share of one target prefill, priced by the
member's timed passes) spent on sink and tail tokens or half of them on the interior tokens the source's last
tokens attend to most (`RepairPolicy.scattered_share`). The member's own prefill and the plain prompt (the window
then the question in one user turn) are the references. Greedy, the bench's 24 new tokens and stops. Answers are
kept in the JSON as they come, so an interrupted run resumes. Writes results/qa_repair_curve.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _qa_runs import ResumableResults, chosen, passage_windows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WINDOW = 512


def settings() -> dict[str, tuple[str, int, Any]]:
    """Name -> (what it does, recomputed tail tokens, repair policy or None)."""
    from mappings.repair import RepairPolicy

    out: dict[str, tuple[str, int, Any]] = {
        "pure": ("the pure map, 32-token tail (the tasks bench's `mapped`)", 32, None),
        "tail128": ("the pure map, 128-token tail", 128, None),
    }
    out["r25"] = ("25% budget on sink and tail tokens", 32, RepairPolicy(budget=0.25))
    for budget in (0.10, 0.15, 0.20, 0.25):
        out[f"r{budget * 100:.0f}s"] = (f"{budget:.0%} budget, half on the interior tokens the source reads", 32,
                                        RepairPolicy(budget=budget, scattered_share=0.5))
    return out


def run(names: list[str], limit: int | None, results: dict[str, Any], save: Callable[[], None]) -> None:
    from orchestra.bench import BenchFamily, QAAsker, TaskConfig, is_correct, load_qa
    from orchestra.familycache.gates import GatePolicy

    table = settings()
    open_gate = GatePolicy(offline=None, probe=None)
    cfg = TaskConfig(source="root", members=["finetuned"])
    fam = BenchFamily.bundled(None)
    qa = load_qa(None)
    questions = list(qa.questions)[:limit] if limit else list(qa.questions)
    cache = fam.family_cache("root", tail_tokens=cfg.tail_tokens)
    asker = QAAsker(fam, cache, cfg.max_new_tokens, cfg.stop)
    answers: dict[str, list[Any]] = results.setdefault("answers", {})
    costs: dict[str, list[float]] = results.setdefault("costs", {})
    for _, qs, text, prefix in passage_windows(qa, questions, WINDOW, fam.loaded("root").tokenizer):
        for name in names:
            if all(f"{name}|{q.id}" in answers for q in qs):
                continue
            _, tail, repair = table[name]
            cache.acquire_sync("root", prefix, allow_mapped=False).release()  # the source's entry, to map from
            with cache.acquire_sync("finetuned", prefix, gate=open_gate, tail_tokens=tail, repair=repair) as lease:
                if lease.repair:
                    costs.setdefault(name, []).append(float(str(lease.repair["cost"])))
                for q in qs:
                    reply, _ = asker.ask("finetuned", lease, prefix, q)
                    answers[f"{name}|{q.id}"] = [reply, is_correct(reply, q.answers)]
            cache.clear()  # every setting maps afresh: none may find another's entry
        for q in qs:  # the references: the member's own prefill and the plain prompt
            if f"own|{q.id}" not in answers:
                with cache.acquire_sync("finetuned", prefix, allow_mapped=False) as lease:
                    reply, _ = asker.ask("finetuned", lease, prefix, q)
                answers[f"own|{q.id}"] = [reply, is_correct(reply, q.answers)]
            if f"plain|{q.id}" not in answers:
                reply, _ = asker.ask_plain("finetuned", text, q)
                answers[f"plain|{q.id}"] = [reply, is_correct(reply, q.answers)]
        cache.clear()
        save()


def markdown(results: dict[str, Any], commands: list[str]) -> str:
    table = settings()
    counts: dict[str, list[int]] = {}
    for key, (_, ok) in results.get("answers", {}).items():
        cell = counts.setdefault(key.split("|")[0], [0, 0])
        cell[0] += int(bool(ok))
        cell[1] += 1
    costs = results.get("costs", {})

    def row(name: str, what: str) -> str:
        c = counts[name]
        spent = costs.get(name)
        cost = f"{sum(spent) / len(spent):.0%}" if spent else "-"
        return f"| {name} | {what} | {c[0]}/{c[1]} | {cost} |"

    lines = ["# How much repair the question answerer needs on a mapped cache", "",
             "Commands (each added rows): " + "; ".join(f"`{c}`" for c in commands) + ". The fine-tuned member "
             f"answers the bundled QA set over {WINDOW}-token windows with the built-in `question_answerer`; correct "
             "= a reference answer occurs in the reply (normalised); greedy, 24 new tokens. Mapped rows run on the "
             "root's cache mapped into the member (gates open); *spent* is the repair's mean planned cost, a share "
             "of one prefill of the window on the member (its timed passes).", "",
             "| setting | what | correct | spent |", "|---|---|---|---|"]
    for name, what in (("own", "the member's own prefill (the reference)"),
                       ("plain", "a plain prompt on its own prefill (the baseline to match)")):
        if name in counts:
            lines.append(row(name, what))
    for name, (what, _, _) in table.items():
        if name in counts:
            lines.append(row(name, what))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(settings()), help="comma-separated setting names")
    parser.add_argument("--limit", type=int, default=None, help="ask only the first N questions")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the Markdown from the JSON")
    args = parser.parse_args()
    names = chosen(parser, args.settings, settings(), "settings")
    store = ResumableResults(args.out, "qa_repair_curve", sys.argv[1:], record=not args.report_only)
    if not args.report_only:
        run(names, args.limit, store.data, store.save)
        store.save()
    store.write_markdown(markdown(store.data, store.commands))


if __name__ == "__main__":
    main()
