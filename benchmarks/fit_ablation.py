"""What each calibration change buys a served map (issue 16, goal 1): one change at a time, same data.

    python benchmarks/fit_ablation.py [--member finetuned ...] [--variants served|length|selection|tail|data]
        [--tokens 8192] [--home DIR] [--out DIR]

For each member the root -> member mapping is calibrated three times on the same corpus and budget
as `orchestra family calibrate` (MPL-2.0, Apache-2.0 and GFDL-1.3; 8,192 fitting tokens in
windows of 512), changing one thing at a time from the method as shipped before this change:

- ``before``: every row fitted alike, per-layer λ chosen by the target's held-out KL over the
  map as it comes out;
- ``judged with sinks``: the first 4 positions left out of the fit and made the target's own when
  the KL selection scores a candidate, as a FamilyCache serves every mapped cache;
- ``+ attention values``: also value rows weighed by the attention the target's last 128 queries
  of each window pay them (half attention, half uniform): the method's default now.

The other variant sets (``VARIANT_SETS``) each change one thing from the shipped method: ``length``
the fitting windows, granularity and rank; ``selection`` how many held-out windows and tokens judge
each layer's λ; ``tail`` judging with the probe tail recomputed, and no per-layer choice at all;
``data`` the fitting text (three more licences, twice the tokens, longer windows).

Every mapping is then scored with ``mappings.evaluate`` on the held-out GPL-3 text, which
calibration never sees, as served (``+sinks4``: the first 4 positions exact; ``+tail32``: also the
last 32 recomputed, as a FamilyCache serves it) and as a pure map:

- ``test``: `benchmarks/evaluate_family.py`'s windows, 2 x (3,584 + 128 scored) from token 0;
- ``dev``: 1 window of 3,584 + 128 from token 1,800, whose 128 scored tokens are none of the test
  windows' (the changes were picked on it and on the test windows; a second look at other text).

Writes benchmarks/results/fit_ablation.json and .md (``fit_ablation_<set>`` for the other sets).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The fitting texts of the `data` variants: the shipped two, three more licences, and the shipped held-out text last.
MORE_TEXTS = ("mpl-2.0.txt", "apache-2.0.txt", "artistic.txt", "lgpl-2.1.txt", "mpl-1.1.txt", "gfdl-1.3.txt")
# Each variant: (changes to the member's method spec, changes to the calibration settings; a `corpus`
# there names the texts to calibrate on instead of the shipped ones).
VARIANT_SETS: dict[str, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {
    "served": {
        "before": ({"exact_sinks": 0, "value_weights": "uniform"}, {}),
        "judged with sinks": ({"exact_sinks": 4, "value_weights": "uniform"}, {}),
        "+ attention values": ({"exact_sinks": 4, "value_weights": "attention"}, {}),
    },
    # What a map served at 3.5k tokens gains from fitting on windows that long, per KV head, at full rank.
    "length": {
        "shipped (512-token windows)": ({}, {}),
        "2048-token windows": ({}, {"window": 2048}),
        "per KV head": ({"granularity": "head"}, {}),
        "full rank": ({"rank": None, "rank_fraction": None}, {}),
        "2048-token windows, full rank": ({"rank": None, "rank_fraction": None}, {"window": 2048}),
    },
    # What the per-layer λ choice gains from judging on more held-out tokens than 2 windows x 32 (64 in all).
    "selection": {
        "shipped (2 windows x 32 judged)": ({}, {}),
        "4 held-out windows": ({}, {"heldout_fraction": 0.25}),
        "128 judged tokens per window": ({"kl_suffix_tokens": 128}, {}),
        "4 windows x 128": ({"kl_suffix_tokens": 128}, {"heldout_fraction": 0.25}),
        "8 windows x 128": ({"kl_suffix_tokens": 128}, {"heldout_fraction": 0.5}),
    },
    # What the per-layer λ choice gains from judging each candidate as served: its last 32 positions
    # recomputed on the target, as a FamilyCache recomputes its probe tail on every mapped cache; and,
    # as the floor, no choice at all (every layer at the default λ).
    "tail": {
        "shipped (judged on the whole map)": ({}, {}),
        "judged with the 32-token tail recomputed": ({"judged_tail": 32}, {}),
        "no per-layer choice (default λ everywhere)": ({"selection": "none"}, {}),
    },
    # What a served map gains from more fitting text: the same 8,192 tokens spread over three more texts,
    # twice the tokens, and twice the tokens in windows four times as long. The three texts are the
    # family's other held-out licences, which this ablation never scores on (it scores on GPL-3 only).
    # Two held-out windows judge each layer in every row, as in the shipped calibration.
    "data": {
        "shipped (8,192 tokens of 2 texts)": ({}, {}),
        "8,192 tokens of 5 texts": ({}, {"corpus": MORE_TEXTS, "max_heldout_windows": 2}),
        "16,384 tokens of 5 texts": ({}, {"corpus": MORE_TEXTS, "tokens": 16384, "max_heldout_windows": 2}),
        "16,384 tokens of 5 texts, 2048-token windows": (
            {}, {"corpus": MORE_TEXTS, "tokens": 16384, "window": 2048, "max_heldout_windows": 2}),
    },
}
PREFIX, SUFFIX, DEV_OFFSET, SINKS, TAIL = 3584, 128, 1800, 4, 32


def measure(role: str, tokens: int, home: str | None, variants: str = "served") -> dict[str, Any]:
    from mappings.calibrate import CalibrationSettings, calibrate
    from mappings.compat import check_pair
    from mappings.evaluate import EvaluationSettings, evaluate
    from mappings.methods import resolve_method
    from mappings.models import load_model
    from orchestra.documents.texts import CALIBRATION_TEXTS, HELDOUT_TEXT, data_text
    from orchestra.family import load_family

    family = load_family(home)
    root = next(m for m in family.members.values() if m.role == "root")
    member = next(m for m in family.members.values() if m.role == role)
    src = load_model(family.member_path(root.name))
    tgt = load_model(family.member_path(member.name))
    card = check_pair(src.model, src.tokenizer, tgt.model, tgt.tokenizer)
    base = resolve_method("auto", same_kv_shape=card.same_kv_shape, same_kv_heads=card.same_kv_heads,
                          same_depth=card.same_depth)
    ids = tgt.tokenizer(data_text(HELDOUT_TEXT), add_special_tokens=False)["input_ids"]
    rows = []
    for label, (change, calibration) in VARIANT_SETS[variants].items():
        spec = base.model_copy(update=change)
        settings_used = {"tokens": tokens, "window": 512, **calibration}
        names = tuple(settings_used.pop("corpus", CALIBRATION_TEXTS))
        corpus = [(name, data_text(name)) for name in names]
        t0 = time.perf_counter()
        mapping = calibrate(src, tgt, corpus, CalibrationSettings(method=spec, **settings_used), progress=False)
        seconds = time.perf_counter() - t0
        row: dict[str, Any] = {"variant": label, "method": spec.name, **change, **settings_used, "corpus": list(names),
                               "calibration_seconds": seconds, "heldout_kl": mapping.manifest.heldout["kl"]}
        for split, doc, windows in (("test", ids, 2), ("dev", ids[DEV_OFFSET:], 1)):
            settings = EvaluationSettings(prefix_tokens=PREFIX, suffix_tokens=SUFFIX, windows=windows, tail_tokens=TAIL,
                                          greedy_tokens=0, baselines=(), layer_curves=False, sink_tokens=SINKS,
                                          repair_costs="compute")
            report = evaluate(mapping, doc, settings, source=src, target=tgt, document_name=HELDOUT_TEXT)
            pure, served = report.row(spec.name), report.row(f"{spec.name}+sinks{SINKS}")
            tailed = report.row(f"{spec.name}+tail{TAIL}")
            row[split] = {"kl": served.kl, "top1": served.top1, "pure_kl": pure.kl, "pure_top1": pure.top1,
                          "tail_kl": tailed.kl, "tail_top1": tailed.top1}
        print(f"{role} {label}: test KL {row['test']['kl']:.4f} / top-1 {row['test']['top1']:.3f}, "
              f"dev {row['dev']['kl']:.4f} / {row['dev']['top1']:.3f} ({seconds:.0f} s)", flush=True)
        rows.append(row)
    return {"member": role, "name": member.name, "method": base.name, "rows": rows}


def markdown(results: list[dict[str, Any]], command: str, tokens: int = 8192, variants: str = "served") -> str:
    lines = [
        "# What each calibration change buys a served map", "",
        f"Command: `{command}`", "",
        f"Root -> member mappings calibrated {len(VARIANT_SETS[variants])} times on the same data ({tokens:,} tokens "
        "of MPL-2.0, Apache-2.0 and GFDL-1.3 in windows of 512 unless the variant says otherwise; GFDL-1.3, the "
        "last, is held out and judges each layer), one change at a time; scored on the held-out GPL-3 text as "
        "served "
        f"(first {SINKS} positions exact) and as a pure map. test = 2 windows of {PREFIX} + {SUFFIX} scored tokens "
        f"from token 0 (`evaluate_family.py`'s); dev = 1 window from token {DEV_OFFSET} (other scored tokens). "
        f"KL in nats per token against the member's own prefill; lower is better. With tail: the last {TAIL} "
        "prefix positions also recomputed on the target, as a FamilyCache recomputes its probe tail on every "
        "mapped cache it serves.", "",
        "| member | variant | test KL | test top-1 | dev KL | dev top-1 | with tail: test KL / top-1 | with tail: "
        "dev KL / top-1 | pure map test KL | held-out KL (calibration) | calibration s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def tailed(split: dict[str, Any]) -> str:
        return f"{split['tail_kl']:.4f} / {split['tail_top1']:.3f}" if "tail_kl" in split else "-"

    for res in results:
        for r in res["rows"]:
            lines.append(f"| {res['member']} ({res['method']}) | {r['variant']} | {r['test']['kl']:.4f} | "
                         f"{r['test']['top1']:.3f} | {r['dev']['kl']:.4f} | {r['dev']['top1']:.3f} | "
                         f"{tailed(r['test'])} | {tailed(r['dev'])} | "
                         f"{r['test']['pure_kl']:.4f} | {r['heldout_kl']:.4f} | {r['calibration_seconds']:.0f} |")
    first_label, last_label = list(VARIANT_SETS[variants])[0], list(VARIANT_SETS[variants])[-1]
    lines += ["", f"Change from `{first_label}` to `{last_label}`, served KL:", ""]
    for res in results:
        first, last = res["rows"][0], res["rows"][-1]
        parts = [f"{split} {first[split]['kl']:.4f} -> {last[split]['kl']:.4f} "
                 f"({last[split]['kl'] / first[split]['kl'] - 1:+.0%})" for split in ("test", "dev")]
        lines.append(f"- {res['member']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from _results import command_line, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--member", action="append", help="member role (repeat); default every non-root member")
    parser.add_argument("--tokens", type=int, default=8192, help="fitting tokens per calibration")
    parser.add_argument("--variants", choices=sorted(VARIANT_SETS), default="served",
                        help="served: the changes that made the shipped method; length: fits for long served maps; "
                        "selection: the per-layer choice judged on more held-out tokens; tail: judged as "
                        "served, with the probe tail recomputed; data: more fitting text")
    parser.add_argument("--home", default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    results = [measure(role, args.tokens, args.home, args.variants)
               for role in args.member or ["finetuned", "int8", "quantized", "distilled"]]
    command = command_line("fit_ablation.py", argv)
    stem = "fit_ablation" if args.variants == "served" else f"fit_ablation_{args.variants}"
    write_results(args.out, stem, {"command": command, "results": results},
                  markdown(results, command, args.tokens, args.variants))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
