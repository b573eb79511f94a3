"""What a map costs beside its matrix products: seconds and minor page faults of ``map_cache``.

    python benchmarks/map_memory.py [--members finetuned,quantized] [--length 4096] [--repeats 5]

Per repetition, in one process, on the bundled family: the root prefills the document; the map runs
right after it (what the bench's "map + inject" times: it lands on whatever memory the prefill left),
then once more on the same source cache (memory the process already holds); the member prefills the
same tokens itself. Separately, the map's key and value products alone (its stored weights on random inputs of the
same shape), the arithmetic no change to the map's memory traffic can remove.
Minor page faults are the process's own (``getrusage``): each is a fresh page the kernel had to hand
over, and on this VM one costs tens of microseconds. Writes results/map_memory.json and .md.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float, int]:
    f0, t0 = _faults(), time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0, _faults() - f0


def products_seconds(kv_map: Any, rows: int, repeats: int = 3) -> tuple[float, int]:
    """Fastest of ``repeats`` runs of the map's own key and value products (dense, or low-rank with the
    anchor) on ``rows`` random tokens, and how many there are: the arithmetic of a map without its
    conversions, RoPE and copies."""
    import torch

    from mappings.apply import map_product

    g = torch.Generator().manual_seed(0)
    weights = [(lm.prepared(kind, "cpu"), lm.anchored) for lm in kv_map.layers if lm.mode == "map" for kind in "kv"]
    work = [(torch.randn(rows, (w["weight"] if "weight" in w else w["down"]).shape[0], generator=g), w, anchored)
            for w, anchored in weights]
    if not work:
        return 0.0, 0

    def run() -> None:
        for x, w, anchored in work:
            map_product(x, w, anchored)

    with torch.no_grad():
        run()  # first-call costs
        best = min(_timed(run)[1] for _ in range(repeats))
    return best, len(work)


def measure(source: Any, target: Any, kv_map: Any, ids: list[int], repeats: int) -> dict[str, Any]:
    """Cold and warm map seconds and faults beside the target's prefill; medians over ``repeats``."""
    import torch

    from mappings.apply import map_cache
    from mappings.cache_io import forward_with_cache

    batch = torch.tensor([ids])
    reps: list[dict[str, float]] = []
    with torch.no_grad():
        _, warm, _ = forward_with_cache(source, batch[:, :64], None, logits_to_keep=1)
        map_cache(kv_map, warm, target)  # first-call costs (kernels, the map's reordered weights)
        del warm
        for _ in range(repeats):
            (_, cache, _), source_s, _ = _timed(forward_with_cache, source, batch, None, logits_to_keep=1)
            mapped, cold_s, cold_faults = _timed(map_cache, kv_map, cache, target)
            del mapped
            mapped, warm_s, warm_faults = _timed(map_cache, kv_map, cache, target)
            del mapped, cache
            _, target_s, _ = _timed(forward_with_cache, target, batch, None, logits_to_keep=1)
            reps.append({"source_prefill_s": source_s, "map_cold_s": cold_s, "map_cold_faults": cold_faults,
                         "map_warm_s": warm_s, "map_warm_faults": warm_faults, "target_prefill_s": target_s})
    products_s, products = products_seconds(kv_map, len(ids))
    shape, item = kv_map.target_shape, next(target.parameters()).element_size()
    out: dict[str, Any] = {"tokens": len(ids), "repeats": reps, "products_s": products_s, "products": products,
                           "cache_mb": 2 * shape.width * shape.num_layers * len(ids) * item / 2**20}
    for key in reps[0]:
        out[f"median_{key}"] = statistics.median(r[key] for r in reps)
    out["speedup_cold"] = statistics.median(r["target_prefill_s"] / r["map_cold_s"] for r in reps)
    out["speedup_warm"] = statistics.median(r["target_prefill_s"] / r["map_warm_s"] for r in reps)
    out["speedup_products"] = out["median_target_prefill_s"] / products_s if products_s else None
    return out


def markdown(results: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# What a map costs beside its products", "",
        f"Command: `{command}`. Medians over the repetitions. *Cold*: the map right after the source's prefill "
        "(what `orchestra bench` times as map + inject); *warm*: the same map again on memory the process holds; "
        "*products*: the map's own key and value products alone (dense or low-rank, fastest of 3). Faults are minor "
        "page faults: fresh pages the kernel handed over during the map.", "",
        "| member | tokens | target prefill s | map cold s | faults | speed-up | map warm s | faults | speed-up "
        "| products s | speed-up bound | mapped cache MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        bound = f"{r['speedup_products']:.0f}x" if r["speedup_products"] else "-"
        lines.append(
            f"| {r['member']} | {r['tokens']} | {r['median_target_prefill_s']:.2f} | {r['median_map_cold_s']:.3f} | "
            f"{r['median_map_cold_faults']:,.0f} | {r['speedup_cold']:.0f}x | {r['median_map_warm_s']:.3f} | "
            f"{r['median_map_warm_faults']:,.0f} | {r['speedup_warm']:.0f}x | {r['products_s']:.3f} | {bound} | "
            f"{r['cache_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from _results import command_line, write_results

    from orchestra.bench import BenchFamily, Pair, machine_info
    from orchestra.documents.texts import data_text

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", default="finetuned,quantized", help="comma-separated roles mapped from the root")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--home", default=None, help="family home (default: the bundled one)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = parser.parse_args()

    fam = BenchFamily.bundled(args.home)
    source = fam.loaded("root")
    ids = source.tokenizer(data_text("gpl-3.txt"), add_special_tokens=False)["input_ids"][: args.length]
    results = []
    for role in (r.strip() for r in args.members.split(",")):
        mapping = fam.mapping(Pair(source="root", target=role))  # the stored one; calibrated first if missing
        results.append({"member": role, **measure(source.model, fam.loaded(role).model, mapping.kv_map, ids,
                                                  args.repeats)})
    command = command_line("map_memory.py", None)
    write_results(args.out, "map_memory", {"command": command, "machine": machine_info().model_dump(),
                                           "results": results}, markdown(results, command))


if __name__ == "__main__":
    main()
