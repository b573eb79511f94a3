"""Where does a mapped cache's error grow with context length? (issue 16, goal 1)

    python benchmarks/length_growth.py [--member finetuned] [--cuts 256,512,1024,2048,3584] [--suffix 32]

One pass per member over the held-out GPL-3 text (never in the calibration corpus), laid out as every agent's shared prefix: the source and
the target prefill the longest cut once, the source cache is mapped once, and every shorter cut is
a slice (the map is position-wise, so mapping a slice equals slicing the map). At each cut ``c``
the 32 tokens after ``c`` are scored on the target over caches that mix mapped and true parts,
so each row isolates one suspect:

- ``map``: the mapping as shipped; ``identity``: the source's K/V unchanged (same-layout pairs);
- ``true_keys``: true K, mapped V (what is left is the value error);
- ``true_values``: mapped K, true V (the key error);
- ``true_sinks``: the map with the first ``--sinks`` positions exact (attention sinks; exact K/V of
  those positions cost a ``--sinks``-token forward, nothing precedes them);
- ``true_template``: the map with the chat template's fixed opening exact (the first tokens of
  every chat-native prompt: system turn + user-turn header);

plus, per position bin, the relative error ``|mapped - true| / |true|`` of K and V (mean over
layers and heads) and the share of attention the suffix's queries give to the first ``--sinks``
positions, per cut; and per layer, the next-token KL with that layer alone mapped at the shortest
and the longest cut (which layers' error grows). Growth exponent: the slope of log KL against
log cut length. Writes benchmarks/results/length_growth.json and .md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BINS = ((0, 4), (4, 64), (64, 256), (256, 1024), (1024, 2048), (2048, 4096))


def _slope(xs: list[float], ys: list[float]) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def measure(role: str, cuts: list[int], suffix: int, sinks: int, home: str | None, layout: str = "chat",
            offset: int = 0) -> dict[str, Any]:
    import torch

    from agents.prompt import DocumentPrompt
    from mappings.cache_io import build_cache, cache_layers, forward_with_cache
    from mappings.capture import capture_queries, kv_shape
    from mappings.metrics import next_token_agreement
    from mappings.models import load_model
    from mappings.rope import RopeSpec
    from mappings.store import load_mapping
    from orchestra.documents.texts import data_text
    from orchestra.family import load_family

    family = load_family(home)
    root, member = family.member("root"), family.member(role)
    store = Path(family.home) / "mappings"
    folder = sorted(store.glob(f"{root.name}__to__{member.name}__*"))[-1]
    src = load_model(family.member_path(root.name))
    tgt = load_model(family.member_path(member.name))
    mapping = load_mapping(folder, src.fingerprint, tgt.fingerprint)
    # Laid out as every agent's shared prefix is (chat template head, then the document), so the opening
    # tokens are the template's and the sinks are what they are in a real run.
    # `raw` is what `orchestra evaluate` scores: the document's own tokens, its first token the sink.
    if layout == "raw":
        ids_all = tgt.tokenizer(data_text("gpl-3.txt"), add_special_tokens=False)["input_ids"][offset:]
        opening = 0
    else:
        ids_all = DocumentPrompt(data_text("gpl-3.txt")).token_ids(tgt.tokenizer)
        one, two = (DocumentPrompt(t).token_ids(tgt.tokenizer) for t in ("alpha", "omega"))
        opening = next(i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b)
    longest = max(cuts)
    ids = torch.tensor(ids_all[: longest + suffix])[None]
    cfg = tgt.model.config
    same_layout = kv_shape(src.model.config) == kv_shape(cfg)

    _, true_cache, _ = forward_with_cache(tgt.model, ids[:, :longest], None, logits_to_keep=1)
    true = [(k.clone(), v.clone()) for k, v in cache_layers(true_cache)]
    _, src_cache, _ = forward_with_cache(src.model, ids[:, :longest], None, logits_to_keep=1)
    source = [(k.clone(), v.clone()) for k, v in cache_layers(src_cache)]
    mapped = mapping.kv_map.apply(source, dtype=true[0][0].dtype)

    def cut(layers: list[tuple[Any, Any]], c: int) -> list[tuple[Any, Any]]:
        return [(k[:, :, :c].clone(), v[:, :, :c].clone()) for k, v in layers]

    def score(layers: list[tuple[Any, Any]], c: int, ref: Any) -> dict[str, float]:
        logits, _, _ = forward_with_cache(tgt.model, ids[:, c : c + suffix], build_cache(layers, cfg))
        a = next_token_agreement(ref, logits.float())
        return {"kl": a["kl"], "top1": a["top1"]}

    def with_exact(layers: list[tuple[Any, Any]], upto: int, c: int) -> list[tuple[Any, Any]]:
        out = cut(layers, c)
        for (k, v), (tk, tv) in zip(out, true, strict=True):
            k[:, :, :upto] = tk[:, :, :upto]
            v[:, :, :upto] = tv[:, :, :upto]
        return out

    rows: dict[str, list[dict[str, float]]] = {}
    sink_share: list[float] = []
    rope = RopeSpec.from_config(cfg)
    for c in cuts:
        ref, _, _ = forward_with_cache(tgt.model, ids[:, c : c + suffix], build_cache(cut(true, c), cfg))
        ref = ref.float()
        variants = {
            "map": cut(mapped, c),
            "true_keys": [(tk[:, :, :c], mv[:, :, :c]) for (tk, _), (_, mv) in zip(true, mapped, strict=True)],
            "true_values": [(mk[:, :, :c], tv[:, :, :c]) for (mk, _), (_, tv) in zip(mapped, true, strict=True)],
            "true_sinks": with_exact(mapped, sinks, c),
        }
        if opening:
            variants["true_template"] = with_exact(mapped, opening, c)
        if same_layout:
            variants["identity"] = cut(source, c)
        for name, layers in variants.items():
            rows.setdefault(name, []).append({"cut": c, **score(layers, c, ref)})
        # attention share of the suffix's queries on the first `sinks` positions, true cache, all layers/heads
        with capture_queries(tgt.model) as queries:
            forward_with_cache(tgt.model, ids[:, c : c + suffix], build_cache(cut(true, c), cfg), logits_to_keep=1)
        pos = torch.arange(c, c + suffix)
        share = []
        for i, (k, _v) in enumerate(true):
            d = k.shape[-1]
            q = queries[i].float().reshape(1, suffix, -1, d).transpose(1, 2)
            q = rope.apply(q, pos)
            keys = k[:, :, :c].float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            att = ((q @ keys.transpose(-1, -2)) / math.sqrt(d)).softmax(-1)  # suffix tokens' own keys left out
            share.append(float(att[..., :sinks].sum(-1).mean()))
        sink_share.append(sum(share) / len(share))

    fit_error = []
    for a, z in BINS:
        if a >= longest:
            break
        z = min(z, longest)
        ke = [float((mk[:, :, a:z].float() - tk[:, :, a:z].float()).norm() / tk[:, :, a:z].float().norm())
              for (mk, _), (tk, _) in zip(mapped, true, strict=True)]
        ve = [float((mv[:, :, a:z].float() - tv[:, :, a:z].float()).norm() / tv[:, :, a:z].float().norm())
              for (_, mv), (_, tv) in zip(mapped, true, strict=True)]
        fit_error.append({"positions": [a, z], "key_rel_error": sum(ke) / len(ke), "value_rel_error": sum(ve) / len(ve),
                          "key_rel_error_by_layer": ke, "value_rel_error_by_layer": ve})

    per_layer = []
    short, long_ = min(cuts), max(cuts)
    refs = {}
    for c in (short, long_):
        r, _, _ = forward_with_cache(tgt.model, ids[:, c : c + suffix], build_cache(cut(true, c), cfg))
        refs[c] = r.float()
    for i in range(len(true)):
        entry: dict[str, Any] = {"layer": i}
        for c in (short, long_):
            layers = cut(true, c)
            layers[i] = (mapped[i][0][:, :, :c], mapped[i][1][:, :, :c])
            entry[f"kl@{c}"] = score(layers, c, refs[c])["kl"]
        entry["growth"] = entry[f"kl@{long_}"] / max(entry[f"kl@{short}"], 1e-12)
        per_layer.append(entry)

    exponents = {name: _slope([r["cut"] for r in rs], [r["kl"] for r in rs]) for name, rs in rows.items()}
    return {"member": member.name, "role": role, "layout": layout, "offset": offset, "mapping": folder.name, "method": mapping.manifest.method.name,
            "cuts": cuts, "suffix": suffix, "sinks": sinks, "template_tokens": opening, "rows": rows,
            "growth_exponents": exponents, "sink_attention_share": sink_share, "fit_error_by_position": fit_error,
            "per_layer": per_layer}


def measure_fixed(role: str, cuts: list[int], suffix: int, sinks: int, home: str | None, layout: str,
                  ends: list[int]) -> dict[str, Any]:
    """Length with the text held fixed: the same ``suffix`` tokens at each of ``ends`` are scored after the
    ``c`` text tokens before them, for every cut ``c`` (behind the chat template's opening in the chat layout).

    The plain design (:func:`measure`) scores different text at every cut, so a hard stretch of text reads
    as growth; here only the amount of mapped context changes between columns.
    """
    import torch

    from agents.prompt import DocumentPrompt
    from mappings.cache_io import build_cache, cache_layers, forward_with_cache
    from mappings.capture import kv_shape
    from mappings.metrics import next_token_agreement
    from mappings.models import load_model
    from mappings.store import load_mapping
    from orchestra.documents.texts import data_text
    from orchestra.family import load_family

    family = load_family(home)
    root, member = family.member("root"), family.member(role)
    folder = sorted((Path(family.home) / "mappings").glob(f"{root.name}__to__{member.name}__*"))[-1]
    src = load_model(family.member_path(root.name))
    tgt = load_model(family.member_path(member.name))
    mapping = load_mapping(folder, src.fingerprint, tgt.fingerprint)
    cfg = tgt.model.config
    text = tgt.tokenizer(data_text("gpl-3.txt"), add_special_tokens=False)["input_ids"]
    head: list[int] = []
    if layout == "chat":
        one, two = (DocumentPrompt(t).token_ids(tgt.tokenizer) for t in ("alpha", "omega"))
        head = one[: next(i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b)]
    for e in ends:
        if e - max(cuts) < 0 or e + suffix > len(text):
            raise SystemExit(f"--ends {e}: needs {max(cuts)} tokens before it and {suffix} after (text has {len(text)})")
    same_layout = kv_shape(src.model.config) == kv_shape(cfg)
    firsts = sorted({sinks, len(head)} - {0})

    def splice(mapped: list[tuple[Any, Any]], true: list[tuple[Any, Any]], k_from: str, v_from: str, upto: int = 0):
        out = []
        for (mk, mv), (tk, tv) in zip(mapped, true, strict=True):
            k = (tk if k_from == "true" else mk).clone()
            v = (tv if v_from == "true" else mv).clone()
            k[:, :, :upto] = tk[:, :, :upto]
            v[:, :, :upto] = tv[:, :, :upto]
            out.append((k, v))
        return out

    per: dict[str, dict[int, list[dict[str, float]]]] = {}
    for e in ends:
        for c in cuts:
            ids = torch.tensor(head + text[e - c : e + suffix])[None]
            n = len(head) + c
            _, tc, _ = forward_with_cache(tgt.model, ids[:, :n], None, logits_to_keep=1)
            true = [(k.clone(), v.clone()) for k, v in cache_layers(tc)]
            _, sc, _ = forward_with_cache(src.model, ids[:, :n], None, logits_to_keep=1)
            source = [(k.clone(), v.clone()) for k, v in cache_layers(sc)]
            mapped = mapping.kv_map.apply(source, dtype=true[0][0].dtype)
            ref, _, _ = forward_with_cache(tgt.model, ids[:, n:], build_cache(true, cfg))
            variants = {
                "map": splice(mapped, true, "map", "map"),
                "true_keys": splice(mapped, true, "true", "map"),
                "true_values": splice(mapped, true, "map", "true"),
            }
            for f in firsts:
                variants[f"true_first{f}"] = splice(mapped, true, "map", "map", f)
            if same_layout:
                variants["identity"] = [(k.clone(), v.clone()) for k, v in source]
            for name, layers in variants.items():
                logits, _, _ = forward_with_cache(tgt.model, ids[:, n:], build_cache(layers, cfg))
                a = next_token_agreement(ref.float(), logits.float())
                per.setdefault(name, {}).setdefault(c, []).append({"end": e, "kl": a["kl"], "top1": a["top1"]})
            print(f"  {role} end {e} cut {c}: map KL {per['map'][c][-1]['kl']:.4f}", flush=True)
    rows = {name: [{"cut": c, "kl": sum(x["kl"] for x in by[c]) / len(by[c]),
                    "top1": sum(x["top1"] for x in by[c]) / len(by[c]), "per_end": by[c]} for c in cuts]
            for name, by in per.items()}
    exponents = {name: _slope([r["cut"] for r in rs], [r["kl"] for r in rs]) for name, rs in rows.items()}
    return {"member": member.name, "role": role, "layout": layout, "design": "fixed_suffix", "ends": ends,
            "mapping": folder.name, "method": mapping.manifest.method.name, "cuts": cuts, "suffix": suffix,
            "sinks": sinks, "template_tokens": len(head), "rows": rows, "growth_exponents": exponents}


def markdown(results: list[dict[str, Any]], command: str) -> str:
    suffix = results[0]["suffix"] if results else 32
    lines = ["# Where a mapped cache's error grows with length", "", f"`{command}`", "",
             f"KL of the next {suffix} tokens' distributions (target over the mixed cache vs target's own cache) after "
             "a prefix of `cut` tokens of the held-out GPL-3 text; exponent = slope of log KL vs log cut.", ""]
    for res in results:
        cuts = res["cuts"]
        start = f", text from token {res['offset']}" if res.get("offset") else ""
        lines += [f"## {res['role']} ({res['member']}, {res['method']}), {res['layout']} layout{start}", "",
                  "| cache | " + " | ".join(f"KL@{c}" for c in cuts) + " | top-1@" + str(cuts[-1])
                  + f" | KL@{cuts[-1]} / KL@1024 | exponent |",
                  "|---|" + "---:|" * (len(cuts) + 3)]
        for name, rs in res["rows"].items():
            kl = {r["cut"]: r["kl"] for r in rs}
            ratio = f"{kl[cuts[-1]] / kl[1024]:.2f}" if 1024 in kl and kl[1024] > 0 else "-"
            exp = res["growth_exponents"][name]
            lines.append(f"| {name} | " + " | ".join(f"{kl[c]:.4f}" for c in cuts) + f" | {rs[-1]['top1']:.3f} | "
                         f"{ratio} | {'-' if exp is None else f'{exp:+.2f}'} |")
        if res.get("design") == "fixed_suffix":
            lines += ["", f"Same text at every cut: the {res['suffix']} tokens at text positions "
                      + ", ".join(str(e) for e in res["ends"]) + f" (mean over the {len(res['ends'])}), after the "
                      f"cut's text tokens" + (f" behind the chat template's {res['template_tokens']}-token opening"
                                              if res["template_tokens"] else "") + ".", "",
                      "| cache | end | " + " | ".join(f"KL@{c}" for c in cuts) + " |", "|---|---:|" + "---:|" * len(cuts)]
            for name in ("map", *(n for n in res["rows"] if n.startswith("true_first"))):
                for i, e in enumerate(res["ends"]):
                    lines.append(f"| {name} | {e} | " + " | ".join(f"{r['per_end'][i]['kl']:.4f}" for r in res["rows"][name])
                                 + " |")
            lines.append("")
            continue
        lines += ["", f"Attention share of the suffix's queries on the first {res['sinks']} positions (true cache): "
                  + ", ".join(f"{c}: {s:.2f}" for c, s in zip(cuts, res["sink_attention_share"], strict=True)), "",
                  "| positions | key rel. error | value rel. error |", "|---|---:|---:|"]
        for f in res["fit_error_by_position"]:
            a, z = f["positions"]
            lines.append(f"| {a}-{z} | {f['key_rel_error']:.4f} | {f['value_rel_error']:.4f} |")
        worst = sorted(res["per_layer"], key=lambda e: -e[f"kl@{cuts[-1]}"])[:6]
        lines += ["", f"Layers whose map alone costs most at {cuts[-1]} tokens:", "",
                  f"| layer | KL@{cuts[0]} | KL@{cuts[-1]} | growth |", "|---:|---:|---:|---:|"]
        for e in worst:
            lines.append(f"| {e['layer']} | {e[f'kl@{cuts[0]}']:.4f} | {e[f'kl@{cuts[-1]}']:.4f} | {e['growth']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """KL against context length (log-log), one panel per member and layout, one line per cache variant."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mappings.atomic import write_atomic

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        for name, rs in res["rows"].items():
            exp = res["growth_exponents"][name]
            ax.plot([r["cut"] for r in rs], [max(r["kl"], 1e-6) for r in rs], marker="o",
                    label=f"{name} ({'-' if exp is None else f'{exp:+.2f}'})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        design = "same text, " if res.get("design") == "fixed_suffix" else ""
        ax.set_title(f"{res['role']}: {design}{res['layout']} layout", fontsize=10)
        ax.set_xlabel("context tokens before the scored tokens")
        ax.set_ylabel("next-token KL vs own prefill (nats)")
        ax.legend(fontsize=7, title="cache (growth exponent)", title_fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
    return path


def main(argv: list[str] | None = None) -> int:
    from _results import command_line, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--member", action="append", help="member role (repeat); default finetuned, int8, quantized")
    parser.add_argument("--cuts", default="256,512,1024,2048,3584")
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--layout", action="append", choices=["chat", "raw"],
                        help="chat: as every agent's shared prefix (default); raw: the text's own tokens, as "
                             "`orchestra evaluate` scores; repeat for both")
    parser.add_argument("--offset", type=int, default=0,
                        help="raw layout: start the text at this token (`orchestra evaluate`'s second window starts "
                             "at prefix + suffix)")
    parser.add_argument("--design", choices=["cut", "fixed"], default="cut",
                        help="cut: one pass, the tokens after each cut scored (text changes with the cut); fixed: the "
                             "same tokens at each of --ends scored after every cut's context (text held fixed)")
    parser.add_argument("--ends", default="3700,4700,5700,6700", help="fixed design: text positions of the scored tokens")
    parser.add_argument("--home", default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    cuts = sorted(int(c) for c in args.cuts.split(","))
    results = []
    for role in args.member or ["finetuned", "int8", "quantized"]:
        print(f"measuring {role} ...", flush=True)
        for layout in args.layout or ["chat"]:
            if args.design == "fixed":
                ends = [int(e) for e in args.ends.split(",")]
                results.append(measure_fixed(role, cuts, args.suffix, args.sinks, args.home, layout, ends))
            else:
                results.append(measure(role, cuts, args.suffix, args.sinks, args.home, layout, args.offset))
    command = command_line("length_growth.py", argv)
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(results, args.out / "length_growth.png")
    md = markdown(results, command) + f"\n![KL against context length]({png.name})\n"
    write_results(args.out, "length_growth", {"command": command, "results": results}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
