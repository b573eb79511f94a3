"""Which wording of the question answerer answers best: prompt variants against the plain-prompt baseline.

    python benchmarks/qa_prompt_variants.py [--variants current,nopen,...] [--windows 512] [--limit N]

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
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONDITIONS = ("root:own", "finetuned:own")


def variants() -> dict[str, tuple[str, Callable[[str, int], Any]]]:
    """Name -> (what it changes, a factory of the question answerer's spec for (question, max_new_tokens))."""
    from agents import BUILTINS
    from agents.spec import GenerationSettings, escape_template

    base = BUILTINS["question_answerer"]

    def change(q: str, max_new: int, *, role: str | None = None, task: str | None = None, penalty: bool = True) -> Any:
        spec = base(question=q, max_new_tokens=max_new)
        update: dict[str, Any] = {}
        if role is not None:
            update["role"] = role
        if task is not None:
            update["task"] = task
        if not penalty:
            update["generation"] = GenerationSettings(max_new_tokens=max_new)
        # validated afresh, not `model_copy`: a spec parses its task into template segments when it is validated
        return type(spec)(**{**{name: getattr(spec, name) for name in type(spec).model_fields}, **update})

    return {
        "current": ("the built-in as shipped", lambda q, n: change(q, n)),
        "nopen": ("no repetition penalty or n-gram ban", lambda q, n: change(q, n, penalty=False)),
        "bare": ("no role; the task is the question alone; no penalty",
                 lambda q, n: change(q, n, role="", task=escape_template(q), penalty=False)),
        "q_then_hint": ("no role; the question, then 'Answer from the document above.'; no penalty",
                        lambda q, n: change(q, n, role="", task=f"{escape_template(q)}\nAnswer from the document above.",
                                            penalty=False)),
        "hint_then_q": ("no role; 'Answer from the document above: <question>'; no penalty",
                        lambda q, n: change(q, n, role="", task=f"Answer from the document above: {escape_template(q)}",
                                            penalty=False)),
        "short_role": ("no role; 'Question: <q>' then 'Answer it from the document above, briefly.'; no penalty",
                       lambda q, n: change(q, n, role="", penalty=False,
                                           task=f"Question: {escape_template(q)}\nAnswer it from the document above, "
                                                "briefly.")),
    }


def run(names: list[str], windows: list[int], limit: int | None, results: dict[str, list[Any]], save: Callable[[], None],
        home: str | None) -> None:
    from agents import DocumentPrompt
    from orchestra.bench import (
        BenchFamily,
        QAAsker,
        TaskConfig,
        is_correct,
        load_qa,
        passage_window,
        token_offsets,
    )

    table = variants()
    cfg = TaskConfig(source="root", members=["finetuned"])
    fam = BenchFamily.bundled(home)
    qa = load_qa(None)
    chosen = list(qa.questions)[:limit] if limit else list(qa.questions)
    groups = qa.by_passage(chosen)
    tok = fam.loaded("root").tokenizer
    cache = fam.family_cache("root", tail_tokens=cfg.tail_tokens)
    plain = QAAsker(fam, cache, cfg.max_new_tokens, cfg.stop)
    askers = {name: QAAsker(fam, cache, cfg.max_new_tokens, cfg.stop, agent=table[name][1]) for name in names}
    offsets: dict[str, list[tuple[int, int]]] = {}
    for window in windows:
        for pid, qs in groups.items():
            passage = qa.passage(pid)
            doc = qa.document_text(passage.document)
            if passage.document not in offsets:
                offsets[passage.document] = token_offsets(doc, tok)
            text, _ = passage_window(doc, passage.start, passage.end, window, tok, offsets[passage.document])
            prefix = DocumentPrompt(text).token_ids(tok)
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
                with cache.acquire_sync(member, prefix, allow_mapped=False) as lease:
                    for name, q in todo:
                        reply, _ = askers[name].ask(member, lease, prefix, q)
                        results[f"{name}|{window}|{member}|{how}|{q.id}"] = [reply, is_correct(reply, q.answers)]
            cache.clear()
            save()


def markdown(results: dict[str, list[Any]], command: str) -> str:
    table = variants()
    counts: dict[tuple[str, str, str], list[int]] = {}
    for key, (_, ok) in results.items():
        name, window, member, how, _qid = key.split("|")
        cell = counts.setdefault((name, window, f"{member}:{how}"), [0, 0])
        cell[0] += int(bool(ok))
        cell[1] += 1
    windows = sorted({w for _, w, _ in counts}, key=int)
    lines = ["# Question-answerer wordings against the plain prompt", "",
             f"Command: `{command}`. Correct answers out of the questions asked (a reference answer occurs in the "
             "reply, normalised); greedy, 24 new tokens, stops at a blank line or `Question:`. *plain*: the window "
             "then the question in one user turn of the member's chat template, on its own prefill (no shared "
             "prefix). Every other row keeps orchestra's shared document prefix.", ""]
    for window in windows:
        lines += [f"## {window}-token windows", "",
                  "| variant | what it changes | root | finetuned |", "|---|---|---|---|"]
        plain = [counts.get(("plain", window, f"{m}:plain")) for m in ("root", "finetuned")]
        lines.append("| plain | the baseline | "
                     + " | ".join(f"{c[0]}/{c[1]}" if c else "-" for c in plain) + " |")
        for name, (what, _) in table.items():
            cells = [counts.get((name, window, c)) for c in CONDITIONS]
            if any(cells):
                lines.append(f"| {name} | {what} | " + " | ".join(f"{c[0]}/{c[1]}" if c else "-" for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    from mappings.atomic import write_atomic

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(variants()), help="comma-separated variant names")
    parser.add_argument("--windows", default="512", help="comma-separated window lengths, document tokens")
    parser.add_argument("--limit", type=int, default=None, help="ask only the first N questions")
    parser.add_argument("--home", default=None, help="family home (default: the bundled one)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the Markdown from the JSON")
    args = parser.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = sorted(set(names) - set(variants()))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(variants())}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "qa_prompt_variants.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    results: dict[str, list[Any]] = stored.get("answers", {})
    command = stored.get("command") if args.report_only else None
    command = command or "python benchmarks/qa_prompt_variants.py " + " ".join(sys.argv[1:])

    def save() -> None:
        write_atomic(path, json.dumps({"command": command, "answers": results}, indent=0))

    if not args.report_only:
        run(names, [int(w) for w in args.windows.split(",")], args.limit, results, save, args.home)
        save()
    write_atomic(args.out / "qa_prompt_variants.md", markdown(results, command))


if __name__ == "__main__":
    main()
