"""The tasks bench's goals read on both question sets pooled, each with its 95 % interval.

    python benchmarks/qa_pooled.py [--group 'LABEL=a.json,b.json' ...] [--member finetuned] [--out DIR]

A goal such as "retention >= 95 %" is a claim about a few dozen right answers, and one greedy answer
that flips on a near-tie moves it by several points. This script pools the answers of several
`orchestra bench --sections tasks` results (by default the two document sets, 128 questions, at each
window length measured on the family's current 8,192-token map) and reads, per member:

- retention of the mapped and the mapped + repaired cache, with a paired bootstrap interval over the
  questions, and the questions lost and gained against the member's own prefill;
- agreement (normalised exact match) with the own-prefill answers, with a Wilson interval;
- the shipped gates' catch and false-alarm rates over the windows, with Wilson intervals;
- for each goal, whether the interval says met, not met, or that these questions cannot tell, and
  about how many questions would narrow the retention's interval to +-5 points.

Writes <name>.json and .md (default benchmarks/results/qa_pooled).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
# Runs on the family's current map (calibrated 2026-12-07T06:26, 8,192 tokens), both question sets each.
DEFAULT_GROUPS = {
    "512 tokens, built-in repair": ["qa_faithful_signals.json", "qa_faithful_heldout_signals.json"],
    "2,048 tokens, 10 % question-directed repair": ["qa_repair10_question_2k.json",
                                                    "qa_repair10_question_heldout_2k.json"],
}
GOALS = {"retention mapped": 0.95, "retention repaired": 1.0, "catch": 0.8}
"""Issue goals: a share that must reach the bound (false alarms, the one bound from above, are read apart)."""
MAX_FALSE_ALARM = 0.2


def verdict(low: float | None, high: float | None, goal: float, *, at_most: bool = False) -> str:
    """Met, not met, or open, from a 95 % interval against a goal (``at_most``: the goal is an upper bound)."""
    if low is None or high is None:
        return "-"
    if at_most:
        low, high, goal = -high, -low, -goal
    if low >= goal:
        return "met"
    if high < goal:
        return "not met"
    return "open"


def load_section(path: Path) -> Any:
    from orchestra.bench import BenchResults

    section = BenchResults.model_validate_json(path.read_text()).tasks
    if section is None:
        raise SystemExit(f"{path} has no tasks section: run `orchestra bench --sections tasks --out {path}`")
    return section


def pooled_member(sections: list[Any], member: str) -> dict[str, Any]:
    """One member's answers over every section, scored as one set, and its gates' windows summed."""
    from orchestra.bench import score_answers, wilson

    row: dict[str, Any] = {"member": member}
    answers = [a.model_copy(update={"question": f"{i}:{a.question}"})  # ids are per set: keep them apart
               for i, k in enumerate(sections) for a in k.answers if a.member == member]
    own = {a.question: a for a in answers if a.condition == "own"}
    for condition in ("own", "mapped", "mapped+repair"):
        rows = [a for a in answers if a.condition == condition]
        if rows:
            row[condition] = score_answers(member, condition, rows, None if condition == "own" else own).model_dump()
    harmed = caught = unharmed = alarms = windows = fell_back = 0
    for k in sections:
        g = next((g for g in k.gates if g.member == member), None)
        if g is None:
            continue
        windows, fell_back = windows + g.windows, fell_back + g.fell_back
        harmed += g.harmed
        caught += round((g.catch_rate or 0.0) * g.harmed)
        unharmed += g.windows - g.harmed
        alarms += round((g.false_alarm_rate or 0.0) * (g.windows - g.harmed))
    row["gates"] = {"windows": windows, "fell_back": fell_back, "harmed": harmed, "caught": caught,
                    "unharmed": unharmed, "false_alarms": alarms,
                    "catch_rate": caught / harmed if harmed else None,
                    "catch_interval": wilson(caught, harmed) if harmed else None,
                    "false_alarm_rate": alarms / unharmed if unharmed else None,
                    "false_alarm_interval": wilson(alarms, unharmed) if unharmed else None}
    return row


def questions_for(half_width: float, questions: int, interval: list[float] | tuple[float, float] | None) -> int | None:
    """About how many questions, at the same mix of answers, would narrow ``interval`` to +-``half_width``
    (an interval's width falls as one over the square root of the questions)."""
    if interval is None or interval[1] <= interval[0]:
        return None
    return math.ceil(round(questions * ((interval[1] - interval[0]) / 2 / half_width) ** 2, 6))


def measure(groups: dict[str, list[Path]], members: list[str] | None) -> list[dict[str, Any]]:
    out = []
    for label, paths in groups.items():
        sections = [load_section(p) for p in paths]
        names = members or [g.member for g in sections[0].gates]
        repair = [k.repair for k in sections]
        out.append({"group": label, "files": [p.name for p in paths],
                    "questions": sum(k.questions for k in sections),
                    "window_tokens": sorted({k.config.window_tokens for k in sections}),
                    "repair": repair[0] if all(r == repair[0] for r in repair) else repair,
                    "repair_spent": [sum(k.repair_costs) / len(k.repair_costs) if k.repair_costs else None
                                     for k in sections],
                    "members": [pooled_member(sections, m) for m in names]})
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _with(v: float | None, interval: list[float] | tuple[float, float] | None) -> str:
    return _pct(v) if v is None or interval is None else f"{v:.0%} ({interval[0]:.0%}-{interval[1]:.0%})"


def _retention(score: dict[str, Any]) -> str:
    """A cache's retention with its interval and the questions it lost and gained, or ``-``."""
    if not score:
        return "-"
    return f"{_with(score.get('retention'), score.get('retention_interval'))}, -{score['lost']}/+{score['gained']}"


def _low_high(row: dict[str, Any], key: str) -> tuple[float | None, float | None]:
    interval = row.get(key)
    return (interval[0], interval[1]) if interval else (None, None)


def markdown(results: list[dict[str, Any]], command: str) -> str:
    lines = ["# The tasks bench's goals on both question sets pooled", "", f"Command: `{command}`", "",
             "Each group pools `orchestra bench --sections tasks` runs on the two question sets (the bundled licences "
             "of the first set and the held-out ones of the second), answered by `question_answerer` on the member's "
             "own prefill, the pure map (32-token tail recomputed) and the map repaired as the run says. "
             "Retention = right answers on the cache / right answers on the own prefill, with a 95 % paired "
             "bootstrap interval over the questions; -lost/+gained = questions the own prefill answers right and the "
             "cache wrong, and the other way round. Agreement = answers equal (normalised) to the own-prefill ones, "
             "95 % Wilson interval. Gates: the shipped gates on every window's pure map; harmed = a window where "
             "the map turned a right own-prefill answer wrong. Verdict: met / not met when the whole interval lies on "
             "one side of the goal, open when it straddles it.", ""]
    for res in results:
        lines += [f"## {res['group']}", "",
                  f"{res['questions']} questions ({', '.join(f'`{f}`' for f in res['files'])}); window "
                  f"{'/'.join(str(w) for w in res['window_tokens'])} tokens.", "",
                  "| member | own right | retention mapped | retention repaired | agreement mapped | "
                  "gates: catch (harmed windows) | gates: false alarm | retention >= 95 % mapped | "
                  ">= 100 % repaired | catch >= 80 % at <= 20 % false alarm | questions for +-5 points of retention |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for m in res["members"]:
            own, mapped, rep, g = m.get("own", {}), m.get("mapped", {}), m.get("mapped+repair", {}), m["gates"]
            v_map = verdict(*_low_high(mapped, "retention_interval"), GOALS["retention mapped"])
            v_rep = verdict(*_low_high(rep, "retention_interval"), GOALS["retention repaired"])
            v_catch = verdict(*_low_high(g, "catch_interval"), GOALS["catch"])
            v_fa = verdict(*_low_high(g, "false_alarm_interval"), MAX_FALSE_ALARM, at_most=True)
            v_gate = "not met" if "not met" in (v_catch, v_fa) else ("met" if v_catch == v_fa == "met" else "open")
            lines.append(
                f"| {m['member']} | {own.get('correct', '-')}/{own.get('n', '-')} | {_retention(mapped)} | {_retention(rep)} | "
                f"{_with(mapped.get('agreement'), mapped.get('agreement_interval'))} | "
                f"{_with(g['catch_rate'], g['catch_interval'])} ({g['caught']}/{g['harmed']}) | "
                f"{_with(g['false_alarm_rate'], g['false_alarm_interval'])} | {v_map} | {v_rep} | {v_gate} | "
                f"{questions_for(0.05, res['questions'], mapped.get('retention_interval')) or '-'} |")
        spent = [s for s in res["repair_spent"] if s is not None]
        if spent:
            lines += ["", "Repair spent " + " and ".join(f"{s:.0%}" for s in spent)
                      + " of a prefill on average (planned, per set)."]
        lines.append("")
    return "\n".join(lines)


def parse_group(text: str) -> tuple[str, list[Path]]:
    label, sep, files = text.partition("=")
    if not sep or not files.strip():
        raise argparse.ArgumentTypeError(f"--group takes LABEL=a.json,b.json, got {text!r}")
    return label.strip(), [Path(f) if Path(f).is_absolute() else RESULTS / f for f in files.split(",")]


def main(argv: list[str] | None = None) -> int:
    from _results import command_line, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", action="append", type=parse_group,
                        help="LABEL=a.json,b.json: tasks results to pool (names relative to benchmarks/results)")
    parser.add_argument("--member", action="append", help="member to read (repeat); default every mapped member")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="qa_pooled")
    args = parser.parse_args(argv)
    groups = dict(args.group) if args.group else {k: [RESULTS / f for f in v] for k, v in DEFAULT_GROUPS.items()}
    missing = [str(p) for paths in groups.values() for p in paths if not p.is_file()]
    if missing:
        print(f"error: no such tasks result: {', '.join(missing)}; run `orchestra bench --sections tasks` first",
              file=sys.stderr)
        return 2
    results = measure(groups, args.member)
    command = command_line("qa_pooled.py", argv)
    write_results(args.out, args.name, {"command": command, "results": results}, markdown(results, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
