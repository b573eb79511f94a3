"""A family made of what users have: the bundled root plus LoRA adapters over it, as members.

    python benchmarks/own_family.py [--tokens 4096] [--prefix 1024] [--windows 2]

Members: the SmolLM2 root (fp32) and four peft LoRA adapters over it, each a member of its own:
``tuned``, the family's shipped fine-tune delta (a real trained adapter: the bundled ``finetuned``
member is its merge), and three rank-8 adapters made here with random B factors (``all`` on every
layer, ``upper`` on layers 15-29, ``top`` on q/v of layers 24-29), so the exact-lower-layers rule is
exercised at three depths. Measured, in one run:

1. memory: bytes of the distinct tensors the five members hold against the root alone and against five
   merged copies, and the process RSS after loading the root and after the adapters;
2. map quality per adapter: a root -> adapter map calibrated here (`--tokens`), evaluated on the held-out
   GPL-3 text (`mappings.evaluate`): next-token KL of the mapped cache against the adapter's own prefill,
   beside the identity baseline (the root's cache used as it is), with the layers carried exactly;
3. a pipeline with one agent per member over one document: cache paths, prefills paid, prefill seconds
   spent and saved (from the run report).

Writes ``benchmarks/results/own_family.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python benchmarks/...`: `tests.fixtures` is importable
RESULTS = ROOT / "benchmarks" / "results"


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens per root -> adapter map")
    parser.add_argument("--method", default="anchored",
                        help="calibration method (the store's 'auto' adds a KL-judged layer search: minutes per map)")
    parser.add_argument("--prefix", type=int, default=1024, help="evaluated prefix tokens")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import warnings

    from mappings.evaluate import EvaluationSettings, evaluate
    from orchestra.bench import machine_info
    from orchestra.family import load_family
    from orchestra.family.corpus import data_text
    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.models.modelref import AdapterSpec
    from orchestra.models.registry import ModelRegistry
    from orchestra.paths import default_home
    from orchestra.pipelines.spec import PipelineSpec
    from orchestra.runs.scheduler import Orchestra
    from tests.fixtures.adapters import distinct_bytes, make_lora_adapter

    warnings.filterwarnings("ignore", message="no mapping for")
    family = load_family(default_home())
    root_dir = Path(family.member("root").path)
    result: dict[str, object] = {"machine": machine_info().model_dump(), "args": vars(args) | {"out": str(args.out)}}
    with tempfile.TemporaryDirectory(prefix="orchestra-own-family-") as tmp:
        scratch = Path(tmp)
        adapters = {
            "tuned": ROOT / "orchestra" / "family" / "deltas" / "finetuned",
            "all": make_lora_adapter(root_dir, scratch / "all", seed=1),
            "upper": make_lora_adapter(root_dir, scratch / "upper", layers=range(15, 30), seed=2),
            "top": make_lora_adapter(root_dir, scratch / "top", layers=range(24, 30), targets=["q_proj", "v_proj"],
                                     seed=3),
        }
        aliases: dict[str, str | AdapterSpec] = {"root": "root"}
        aliases |= {name: AdapterSpec(str(path), "root") for name, path in adapters.items()}
        registry = ModelRegistry(aliases, family=family, default_device="cpu")

        # -- 1. memory
        rss0 = _rss()
        root = registry.load("root")
        rss_root = _rss()
        members = {name: registry.load(name) for name in adapters}
        rss_all = _rss()
        one = distinct_bytes(root.model)
        together = distinct_bytes(root.model, *(m.model for m in members.values()))
        result["memory"] = {
            "root_bytes": one, "root_plus_adapters_bytes": together, "ratio_to_one_model": together / one,
            "merged_copies_bytes": one * (1 + len(adapters)),
            "rss_before": rss0, "rss_after_root": rss_root, "rss_after_adapters": rss_all,
            "adapter_bytes": {n: m.info.adapter.adapter_bytes for n, m in members.items() if m.info.adapter},
            "untouched_layers": {n: m.info.adapter.untouched_layers for n, m in members.items() if m.info.adapter},
        }
        print(json.dumps(result["memory"], indent=2))

        # -- 2. maps
        store = MappingStore(scratch / "maps", tokens=args.tokens, method=args.method)
        text = data_text("gpl-3.txt")
        maps = {}
        for name, member in members.items():
            t0 = time.perf_counter()
            mapping, _ = store.get(root, member)
            fit_s = time.perf_counter() - t0
            settings = EvaluationSettings(prefix_tokens=args.prefix, suffix_tokens=32, windows=args.windows,
                                          baselines=("identity",), layer_curves=False, greedy_tokens=16,
                                          repairs=(), repair_costs="compute", timing_repeats=1)
            report = evaluate(mapping, text, settings, source=root.handle(), target=member.handle())
            rows = {r.method: r for r in report.methods}
            mapped = rows[report.mapping_method]
            ident = rows.get("identity")
            maps[name] = {"calibration_s": fit_s, "method": report.mapping_method,
                          "exact_layers": mapping.manifest.exact_layers if hasattr(mapping.manifest, "exact_layers")
                          else None,
                          "kl_mapped": mapped.kl, "top1_mapped": mapped.top1,
                          "kl_identity": ident.kl if ident else None, "top1_identity": ident.top1 if ident else None,
                          "reference_prefill_s": report.reference_prefill_seconds,
                          "map_s": mapped.map_seconds}
            print(name, json.dumps(maps[name]))
        result["maps"] = maps

        # -- 3. a pipeline: one agent per member over one document
        document = data_text("gpl-3.txt")[:6000]
        agents = [{"name": f"on_{m}", "model": m, "builtin": "summarizer", "args": {"max_new_tokens": 8}}
                  for m in aliases]
        spec = PipelineSpec.model_validate({
            "name": "own-family", "source": "root", "default_device": "cpu", "agents": agents,
            "models": {n: (a if isinstance(a, str) else {"adapter": a.adapter, "base": a.base})
                       for n, a in aliases.items()}})
        orch = Orchestra(spec, family=family, mappings=store)
        t0 = time.perf_counter()
        run = asyncio.run(orch.run(document))
        wall = time.perf_counter() - t0
        result["pipeline"] = {
            "document_tokens": run.document_tokens, "wall_s": wall,
            "agents": {a.name: {"status": a.status, "cache_path": a.cache_path, "fallback": a.fallback_reason}
                       for a in run.agents},
            "prefills": [c.model for c in run.caches if c.path == "exact"],
            "prefill_s_spent": run.prefill_s_spent, "prefill_s_saved": run.prefill_s_saved,
        }
        print(json.dumps(result["pipeline"], indent=2))

    args.out.mkdir(parents=True, exist_ok=True)
    tmp_json = args.out / "own_family.json.tmp"
    tmp_json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp_json.replace(args.out / "own_family.json")
    tmp_md = args.out / "own_family.md.tmp"
    tmp_md.write_text(render(result))
    tmp_md.replace(args.out / "own_family.md")
    print(render(result))


def render(result: dict) -> str:  # type: ignore[type-arg]
    mem, maps, pipe = result["memory"], result["maps"], result["pipeline"]
    mib = 2**20
    lines = [
        "# A family of the root and four LoRA adapters (bundled SmolLM2-135M, CPU)", "",
        "Command: `python benchmarks/own_family.py` "
        f"(calibration: {result['args']['method']}, {result['args']['tokens']} tokens per map; evaluation {result['args']['prefix']}-token "
        f"prefix x {result['args']['windows']} windows of the held-out GPL-3 text). Machine: "
        f"{result['machine']['cpu_model']} ({result['machine']['cpu_count']} CPUs), torch {result['machine']['torch']}.", "",
        "## Memory", "",
        "| | bytes | x one model |", "|---|---:|---:|",
        f"| root alone | {mem['root_bytes'] / mib:,.1f} MiB | 1.00 |",
        f"| root + 4 adapters, as members | {mem['root_plus_adapters_bytes'] / mib:,.1f} MiB | "
        f"{mem['ratio_to_one_model']:.3f} |",
        f"| 5 merged copies | {mem['merged_copies_bytes'] / mib:,.1f} MiB | 5.00 |", "",
        f"Process RSS: {mem['rss_before'] / mib:,.0f} MiB before, {mem['rss_after_root'] / mib:,.0f} MiB with the "
        f"root, {mem['rss_after_adapters'] / mib:,.0f} MiB with the adapters.", "",
        "## Root -> adapter maps", "",
        "| adapter | untouched layers | exact layers in the map | KL mapped | top-1 mapped | KL identity | "
        "top-1 identity | map s | adapter's own prefill s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in maps.items():
        lines.append(
            f"| {name} | {mem['untouched_layers'].get(name, '-')} | {m['exact_layers']} | {m['kl_mapped']:.4f} | "
            f"{m['top1_mapped']:.3f} | {m['kl_identity'] if m['kl_identity'] is None else format(m['kl_identity'], '.4f')} | "
            f"{m['top1_identity'] if m['top1_identity'] is None else format(m['top1_identity'], '.3f')} | "
            f"{m['map_s']:.2f} | {m['reference_prefill_s']:.2f} |")
    lines += ["", "## One pipeline, one agent per member", "",
              f"{pipe['document_tokens']}-token document; prefills paid: {', '.join(pipe['prefills'])} "
              f"({len(pipe['prefills'])}); prefill seconds spent {pipe['prefill_s_spent']:.2f}, saved "
              f"{pipe['prefill_s_saved']:.2f}.", "",
              "| agent | status | cache |", "|---|---|---|"]
    for name, a in pipe["agents"].items():
        lines.append(f"| {name} | {a['status']} | {a['cache_path']}{' (' + a['fallback'] + ')' if a['fallback'] else ''} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
