"""Which gate reading notices a harmed answer on a set it was not tuned on.

    python benchmarks/gate_candidates.py --tune benchmarks/results/qa_faithful.json \
        --test benchmarks/results/qa_faithful_heldout.json [--out benchmarks/results] [--name gate_candidates]

Every input is an `orchestra bench --sections tasks` result, whose mapped answers carry every candidate
reading (`orchestra.bench.gate_signals`); `--tune` and `--test` each take one or more, pooled (e.g. both
question sets at one window length to tune, other lengths to test). For each member and reading, the
threshold that refuses 80 % of the harmed questions of the tuning answers is applied unchanged to the test
answers; the table shows catch and false-alarm rates on both, and on the two pooled. Writes <name>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def judged(path: Path, member: str) -> list[Any]:
    """The member's mapped answers of a tasks result as `Judged` rows (readings, harmed, changed)."""
    from orchestra.bench import BenchResults, judged_answers

    section = BenchResults.model_validate_json(path.read_text()).tasks
    if section is None:
        raise SystemExit(f"{path} has no tasks section: run `orchestra bench --sections tasks --out {path}`")
    return judged_answers(member, section.answers)


def members_of(path: Path) -> list[str]:
    from orchestra.bench import BenchResults

    section = BenchResults.model_validate_json(path.read_text()).tasks
    return [g.member for g in section.gates] if section is not None else []


def compare(tune: Path | list[Path], test: Path | list[Path]) -> list[dict[str, Any]]:
    from orchestra.bench import score_candidates

    tunes = tune if isinstance(tune, list) else [tune]
    tests = test if isinstance(test, list) else [test]
    # a member counts where every input has it: a reading tuned on one member is never tested on another
    members = [m for m in members_of(tunes[0]) if all(m in members_of(p) for p in [*tunes[1:], *tests])]
    rows = []
    for member in members:
        a = [j for path in tunes for j in judged(path, member)]
        b = [j for path in tests for j in judged(path, member)]
        tuned = {c.signal: c for c in score_candidates(a)}
        thresholds = {s: c.threshold for s, c in tuned.items() if c.threshold is not None}
        tested = {c.signal: c for c in score_candidates(b, thresholds)}
        pooled = {c.signal: c for c in score_candidates([*a, *b])}
        for signal, c in tuned.items():
            t, p = tested.get(signal), pooled.get(signal)
            rows.append({"member": member, "signal": signal, "runtime": c.runtime, "tune": c.model_dump(),
                         "test": t.model_dump() if t else None, "pooled": p.model_dump() if p else None})
    return rows


def _names(paths: list[Path]) -> str:
    return " + ".join(f"`{p.name}`" for p in paths)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def markdown(rows: list[dict[str, Any]], command: str, tune: list[Path], test: list[Path]) -> str:
    from orchestra.bench import SIGNALS

    what = {s.name: s.what for s in SIGNALS}
    lines = ["# Which gate reading notices a harmed answer, on a set it was not tuned on", "",
             f"Command: `{command}`", "",
             f"Tuned on {_names(tune)}, tested on {_names(test)}. Harmed = the member's own prefill answers right and "
             "the pure map wrong. Each reading's threshold refuses 80 % of the tuning set's harmed questions and is "
             "applied unchanged to the test set; pooled = both sets, threshold tuned on both. Goal: catch >= 80 %, "
             "false alarm <= 20 % on the test set. (oracle) readings need the member's own prefill.", "",
             "| member | reading | threshold | tune catch / false alarm (harmed) | test catch / false alarm (harmed) "
             "| pooled catch / false alarm | pooled AUC |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        tu, te, po = r["tune"], r["test"] or {}, r["pooled"] or {}
        t = "-" if tu["threshold"] is None else f"{tu['threshold']:.4g}"
        auc = po.get("auc")
        lines.append(
            f"| {r['member']} | {r['signal']}: {what.get(r['signal'], '')}{'' if r['runtime'] else ' (oracle)'} | "
            f"{t} | {_pct(tu['catch_rate'])} / {_pct(tu['false_alarm_rate'])} ({tu['harmed']}/{tu['questions']}) | "
            f"{_pct(te.get('catch_rate'))} / {_pct(te.get('false_alarm_rate'))} ({te.get('harmed', 0)}/"
            f"{te.get('questions', 0)}) | {_pct(po.get('catch_rate'))} / {_pct(po.get('false_alarm_rate'))} | "
            f"{'-' if auc is None else f'{auc:.2f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from _results import command_line, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tune", type=Path, nargs="+", required=True,
                        help="tasks results the thresholds are tuned on (pooled)")
    parser.add_argument("--test", type=Path, nargs="+", required=True, help="tasks results they are tested on (pooled)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default="gate_candidates", help="file name of the results, without .json / .md")
    args = parser.parse_args(argv)
    for path in (*args.tune, *args.test):
        if not path.is_file():
            print(f"error: {path} does not exist: run `orchestra bench --sections tasks --out {path}` first",
                  file=sys.stderr)
            return 2
    rows = compare(args.tune, args.test)
    command = command_line("gate_candidates.py", argv)
    write_results(args.out, args.name, {"command": command, "rows": rows}, markdown(rows, command, args.tune, args.test))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
