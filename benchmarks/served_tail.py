"""How long a recomputed tail a served map needs at 3,584 tokens: the family's stored map, tails of 32-128.

    python benchmarks/served_tail.py [--member finetuned] [--tails 32,64,128] [--home DIR] [--out DIR]

A FamilyCache serves a mapped cache with its first 4 positions exact and its last ``tail_tokens``
(`CachePolicy.tail_tokens`, 32 by default) recomputed on the target, which the probe gate reads.
This scores the family's stored root -> member mapping (as `orchestra family calibrate` left it; the
table records its calibration tokens) with ``mappings.evaluate`` on the held-out GPL-3 text, at the
windows `benchmarks/fit_ablation.py` uses (test: 2 x (3,584 + 128 scored) from token 0; dev: 1 from
token 1,800), once per tail length. Cost: the planned compute of the sink and tail passes as a share
of the target's prefill (multiply-adds, attention included), and the measured one (target seconds over
its own prefill's in the same window).

Writes benchmarks/results/served_tail.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _results import command_line, write_results  # noqa: E402  (after the path insert)
from _stored_pair import load_stored_pair  # noqa: E402

PREFIX, SUFFIX, DEV_OFFSET, SINKS = 3584, 128, 1800, 4


def measure(role: str, tails: list[int], home: str | None) -> dict[str, Any]:
    from mappings.evaluate import EvaluationSettings, evaluate
    from orchestra.documents.texts import HELDOUT_TEXT, data_text

    pair = load_stored_pair(role, home)
    src, tgt, mapping = pair.source, pair.target, pair.mapping
    own = mapping.manifest.method.name
    ids = tgt.tokenizer(data_text(HELDOUT_TEXT), add_special_tokens=False)["input_ids"]
    rows = []
    for tail in tails:
        row: dict[str, Any] = {"tail": tail}
        for split, doc, windows in (("test", ids, 2), ("dev", ids[DEV_OFFSET:], 1)):
            settings = EvaluationSettings(prefix_tokens=PREFIX, suffix_tokens=SUFFIX, windows=windows, tail_tokens=tail,
                                          greedy_tokens=0, baselines=(), layer_curves=False, sink_tokens=SINKS,
                                          repair_costs="compute")
            report = evaluate(mapping, doc, settings, source=src, target=tgt, document_name=HELDOUT_TEXT)
            served, tailed = report.row(f"{own}+sinks{SINKS}"), report.row(f"{own}+tail{tail}")
            row[split] = {"kl": tailed.kl, "top1": tailed.top1, "sinks_kl": served.kl, "sinks_top1": served.top1,
                          "planned_cost": tailed.cost_fraction, "measured_cost": tailed.measured_cost}
        print(f"tail {tail}: test {row['test']['kl']:.4f} / {row['test']['top1']:.3f}, "
              f"dev {row['dev']['kl']:.4f} / {row['dev']['top1']:.3f}", flush=True)
        rows.append(row)
    cal = mapping.manifest.calibration
    return {"member": role, "name": pair.name, "method": own, "calibration_tokens": cal.token_count,
            "calibrated_at": mapping.manifest.created_at, "rows": rows}


def markdown(res: dict[str, Any], command: str) -> str:
    lines = [
        "# How long a recomputed tail a served map needs at 3,584 tokens", "",
        f"Command: `{command}`", "",
        f"The family's stored root -> {res['member']} mapping ({res['method']}, fitted on "
        f"{res['calibration_tokens']:,} tokens, calibrated {res['calibrated_at']}), served as a FamilyCache serves it: "
        f"first {SINKS} positions exact, the last `tail` positions recomputed on the target. Held-out GPL-3 text; "
        f"test = 2 windows of {PREFIX:,} + {SUFFIX} scored tokens from token 0, dev = 1 window from token "
        f"{DEV_OFFSET:,}. KL in nats per token against the member's own prefill. Cost = the sink and tail passes "
        "over the target's prefill: planned in multiply-adds (attention included), measured in seconds.", "",
        "| tail | test KL / top-1 | dev KL / top-1 | planned cost | measured cost (test) |",
        "|---|---|---|---|---|",
    ]
    first = res["rows"][0]["test"] if res["rows"] else None
    if first is not None:
        lines.insert(-2, f"Without a tail (sinks only): test {first['sinks_kl']:.4f} / {first['sinks_top1']:.3f}, "
                         f"dev {res['rows'][0]['dev']['sinks_kl']:.4f} / {res['rows'][0]['dev']['sinks_top1']:.3f}.")
        lines.insert(-2, "")
    for r in res["rows"]:
        t, d = r["test"], r["dev"]
        measured = "-" if t["measured_cost"] is None else f"{t['measured_cost']:.1%}"
        lines.append(f"| {r['tail']} | {t['kl']:.4f} / {t['top1']:.3f} | {d['kl']:.4f} / {d['top1']:.3f} | "
                     f"{t['planned_cost']:.1%} | {measured} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--member", default="finetuned", help="member role")
    parser.add_argument("--tails", default="32,64,128", help="tail lengths, comma-separated")
    parser.add_argument("--home", default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    res = measure(args.member, [int(t) for t in args.tails.split(",")], args.home)
    command = command_line("served_tail.py", argv)
    write_results(args.out, "served_tail", {"command": command, **res}, markdown(res, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
