"""Which wording of the question answerer answers best: prompt variants against the plain-prompt baseline.

    python benchmarks/qa_prompt_variants.py [--variants before,nopen,...] [--windows 512] [--limit N]

The bundled QA set (60 extractive questions over the licences, `orchestra bench --sections tasks`), each asked
over a window of document tokens around its passage, on the bundled family, CPU, greedy, the bench's stops and
token budget. Every variant keeps the shared document prefix (`DocumentPrompt`) and changes only the agent's
suffix (role, task) or its decoding settings; it answers on the root's and the fine-tuned member's own
prefills (how a wording fares on mapped caches is the tasks bench's to measure, for the shipped one). The
baseline is what a user would send without orchestra (the window then the question in one user turn,
`plain_prompt_ids`). Answers are kept in the JSON as they come, so an interrupted run resumes. Writes
results/qa_prompt_variants.json and .md.
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

# mapped before own: once the member's own entry exists, a mapped request would find it and reuse it
CONDITIONS = ("root:own", "finetuned:mapped", "finetuned:own")
COLUMNS = ("root:own", "finetuned:own", "finetuned:mapped")


def variants() -> dict[str, tuple[str, Callable[[str, int], Any]]]:
    """Name -> (what it changes, a factory of the question answerer's spec for (question, max_new_tokens))."""
    from agents import BUILTINS
    from agents.spec import AgentSpec, GenerationSettings, escape_template

    shipped = BUILTINS["question_answerer"]
    # the wording shipped before this benchmark chose its successor, written out so its row stays what it was
    role = "You answer questions about documents. Use only what the document says."
    penalty = {"repetition_penalty": 1.15, "no_repeat_ngram_size": 6}

    def spec(q: str, max_new: int, *, task: str, role: str = "", penalty: dict[str, Any] | None = None) -> AgentSpec:
        return AgentSpec(name="answer", role=role, task=task,
                         generation=GenerationSettings(max_new_tokens=max_new, **(penalty or {})))

    def before(q: str) -> str:
        return (f"Question: {escape_template(q)}\n\nAnswer this question from the document above in one to three "
                "sentences. If the document does not answer it, say so.")

    def short(q: str, extra: str = "") -> str:
        return f"Question: {escape_template(q)}\nAnswer it from the document above, briefly.{extra}"

    return {
        "before": ("the built-in before: a role, 'Question: <q>', 1-3 sentences or say so; penalty",
                    lambda q, n: spec(q, n, role=role, task=before(q), penalty=penalty)),
        "nopen": ("the built-in before, without its repetition penalty or n-gram ban",
                  lambda q, n: spec(q, n, role=role, task=before(q))),
        "bare": ("no role; the task is the question alone; no penalty",
                 lambda q, n: spec(q, n, task=escape_template(q))),
        "q_then_hint": ("no role; the question, then 'Answer from the document above.'; no penalty",
                        lambda q, n: spec(q, n, task=f"{escape_template(q)}\nAnswer from the document above.")),
        "hint_then_q": ("no role; 'Answer from the document above: <question>'; no penalty",
                        lambda q, n: spec(q, n, task=f"Answer from the document above: {escape_template(q)}")),
        "short_role": ("no role; 'Question: <q>' then 'Answer it from the document above, briefly.'; no penalty",
                       lambda q, n: spec(q, n, task=short(q))),
        "short_ngram": ("short_role with a 6-token n-gram ban (no penalty)",
                        lambda q, n: spec(q, n, task=short(q), penalty={"no_repeat_ngram_size": 6})),
        "short_say_so": ("short_role, then 'If it does not, say so.'",
                         lambda q, n: spec(q, n, task=short(q, " If it does not, say so."))),
        "brief": ("no role; 'Question: <q>' then 'Answer briefly.' (no 'document above' to describe); n-gram ban",
                  lambda q, n: spec(q, n, task=f"Question: {escape_template(q)}\nAnswer briefly.",
                                    penalty={"no_repeat_ngram_size": 6})),
        "own_words": ("no role; 'Question: <q>' then 'Answer briefly, in the document's own words.'; n-gram ban",
                      lambda q, n: spec(q, n, task=f"Question: {escape_template(q)}\nAnswer briefly, in the "
                                                   "document's own words.", penalty={"no_repeat_ngram_size": 6})),
        "shipped": ("the built-in as shipped now (brief)", lambda q, n: shipped(question=q, max_new_tokens=n)),
    }


def run(names: list[str], windows: list[int], limit: int | None, results: dict[str, list[Any]], save: Callable[[], None],
        home: str | None) -> None:
    from orchestra.bench import BenchFamily, QAAsker, TaskConfig, is_correct, load_qa
    from orchestra.familycache.gates import GatePolicy

    open_gate = GatePolicy(offline=None, probe=None)
    table = variants()
    cfg = TaskConfig(source="root", members=["finetuned"])
    fam = BenchFamily.bundled(home)
    qa = load_qa(None)
    questions = list(qa.questions)[:limit] if limit else list(qa.questions)
    tok = fam.loaded("root").tokenizer
    cache = fam.family_cache("root", tail_tokens=cfg.tail_tokens)
    plain = QAAsker(fam, cache, cfg.max_new_tokens, cfg.stop)
    askers = {name: QAAsker(fam, cache, cfg.max_new_tokens, cfg.stop, agent=table[name][1]) for name in names}
    for window in windows:
        for _, qs, text, prefix in passage_windows(qa, questions, window, tok):
            for member in ("root", "finetuned"):
                for q in qs:
                    key = f"plain|{window}|{member}|plain|{q.id}"
                    if key not in results:
                        reply, _ = plain.ask_plain(member, text, q)
                        results[key] = [reply, is_correct(reply, q.answers)]
            for condition in CONDITIONS:
                member, how = condition.split(":")
                todo = [(n, q) for n in names for q in qs if f"{n}|{window}|{member}|{how}|{q.id}" not in results]
                if not todo:
                    continue
                # mapped: the root's cache mapped into the member, gates open, as the tasks bench's `mapped`
                how_kw = ({"gate": open_gate, "tail_tokens": cfg.tail_tokens} if how == "mapped"
                          else {"allow_mapped": False})
                if how == "mapped":  # the source's own entry, to map from
                    cache.acquire_sync("root", prefix, allow_mapped=False).release()
                with cache.acquire_sync(member, prefix, **how_kw) as lease:
                    for name, q in todo:
                        reply, _ = askers[name].ask(member, lease, prefix, q)
                        results[f"{name}|{window}|{member}|{how}|{q.id}"] = [reply, is_correct(reply, q.answers)]
            cache.clear()
            save()


def markdown(results: dict[str, list[Any]], commands: list[str]) -> str:
    table = variants()
    counts: dict[tuple[str, str, str], list[int]] = {}
    for key, (_, ok) in results.items():
        name, window, member, how, _qid = key.split("|")
        cell = counts.setdefault((name, window, f"{member}:{how}"), [0, 0])
        cell[0] += int(bool(ok))
        cell[1] += 1
    windows = sorted({w for _, w, _ in counts}, key=int)
    lines = ["# Question-answerer wordings against the plain prompt", "",
             "Commands (each added rows): " + "; ".join(f"`{c}`" for c in commands) + ". Correct answers out of the questions asked (a reference answer occurs in the "
             "reply, normalised); greedy, 24 new tokens, stops at a blank line or `Question:`. *plain*: the window "
             "then the question in one user turn of the member's chat template, on its own prefill (no shared "
             "prefix). Every other row keeps orchestra's shared document prefix, on the member's own prefill or, "
             "*finetuned mapped*, on the root's cache mapped into it (gates open, the tail recomputed: the tasks "
             "bench's `mapped`); the plain prompt's fine-tuned cell is its baseline too.", ""]
    for window in windows:
        lines += [f"## {window}-token windows", "",
                  "| variant | what it changes | root | finetuned | finetuned mapped |", "|---|---|---|---|---|"]
        plain = [counts.get(("plain", window, f"{m}:plain")) for m in ("root", "finetuned", "finetuned")]
        lines.append("| plain | the baseline | "
                     + " | ".join(f"{c[0]}/{c[1]}" if c else "-" for c in plain) + " |")
        for name, (what, _) in table.items():
            cells = [counts.get((name, window, c)) for c in COLUMNS]
            if any(cells):
                lines.append(f"| {name} | {what} | " + " | ".join(f"{c[0]}/{c[1]}" if c else "-" for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(variants()), help="comma-separated variant names")
    parser.add_argument("--windows", default="512", help="comma-separated window lengths, document tokens")
    parser.add_argument("--limit", type=int, default=None, help="ask only the first N questions")
    parser.add_argument("--home", default=None, help="family home (default: the bundled one)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the Markdown from the JSON")
    args = parser.parse_args()
    names = chosen(parser, args.variants, variants(), "variants")
    # the table holds every run's rows, so it names every command that added some
    store = ResumableResults(args.out, "qa_prompt_variants", sys.argv[1:], record=not args.report_only)
    results: dict[str, list[Any]] = store.data.setdefault("answers", {})
    if not args.report_only:
        run(names, [int(w) for w in args.windows.split(",")], args.limit, results, store.save, args.home)
        store.save()
    store.write_markdown(markdown(results, store.commands))


if __name__ == "__main__":
    main()
