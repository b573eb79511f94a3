"""What building a cache takes in memory beside the K/V it leaves: peak RSS of a prefill and of a map.

    python benchmarks/build_memory.py [--lengths 512,1024,2048,4096] [--repeats 3] [--member finetuned]

Each measurement runs in a fresh process (so no allocator state is inherited) on the bundled family, CPU:
the model (and for a map, the source's cache) is made first; then RSS is sampled every 2 ms while the
operation runs. Factor = (peak RSS over the RSS before it) / (bytes of the K/V it returns). FamilyCache holds
`BUILD_MEMORY_FACTOR` times a build's K/V against the cache budget while it runs; this is where that number
comes from. Writes results/build_memory.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _peak_during(fn: Any) -> tuple[Any, int]:
    """`fn()`'s result and the process's peak RSS above its RSS just before, sampled every 2 ms."""
    import psutil

    ps = psutil.Process()
    base = ps.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], ps.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = fn()
    finally:
        stop.set()
        sampler.join()
    return out, max(peak[0], ps.memory_info().rss) - base


def measure_one(op: str, tokens: int, member: str, home: str | None) -> dict[str, Any]:
    """In this process: one `op` ("prefill" on the root, or "map" root -> member) over `tokens` tokens."""
    import gc

    import torch

    from mappings.apply import map_cache
    from mappings.cache_io import cache_layers, forward_with_cache
    from orchestra.bench import BenchFamily, Pair
    from orchestra.texts import data_text

    torch.set_grad_enabled(False)
    fam = BenchFamily.bundled(home)
    source = fam.loaded("root")
    text = data_text("gpl-3.txt") * 2
    ids = torch.tensor([source.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]])
    forward_with_cache(source.model, ids[:, :32], None, logits_to_keep=1)  # first-call set-up is not the build's
    if op == "prefill":
        gc.collect()
        (_, cache, _), peak = _peak_during(lambda: forward_with_cache(source.model, ids, None, logits_to_keep=1))
    else:
        mapping = fam.mapping(Pair(source="root", target=member))
        target = fam.loaded(member).model
        _, warm, _ = forward_with_cache(source.model, ids[:, :32], None, logits_to_keep=1)
        map_cache(mapping.kv_map, warm, target)  # the map's first-call set-up, on memory too small to reuse
        del warm
        _, src, _ = forward_with_cache(source.model, ids, None, logits_to_keep=1)
        gc.collect()
        cache, peak = _peak_during(lambda: map_cache(mapping.kv_map, src, target))
    kv = sum(k.nbytes + v.nbytes for k, v in cache_layers(cache))
    return {"op": op, "tokens": tokens, "kv_bytes": kv, "peak_bytes": peak, "factor": peak / kv}


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = ["# What a build takes beside its K/V", "",
             f"Command: `{command}`. Each repetition in a fresh process; peak RSS sampled every 2 ms during the "
             "operation, over the RSS just before it. Factor = peak / the K/V the operation returns; FamilyCache "
             "holds `BUILD_MEMORY_FACTOR` x a build's K/V against the cache budget while it runs.", "",
             "| operation | tokens | K/V MiB | peak MiB (median) | factor (median) | factor (max) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['tokens']} | {r['kv_bytes'] / 2**20:.0f} | {r['median_peak_bytes'] / 2**20:.0f} "
                     f"| {r['median_factor']:.2f} | {r['max_factor']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--member", default="finetuned", help="the member a map goes to")
    parser.add_argument("--ops", default="prefill,map")
    parser.add_argument("--home", default=None, help="family home (default: the bundled one)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--one", nargs=2, metavar=("OP", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child: one measurement, as JSON on the last line
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.member, args.home)))
        return

    from mappings.atomic import write_atomic
    from orchestra.bench import machine_info

    rows = []
    for op in args.ops.split(","):
        for tokens in (int(n) for n in args.lengths.split(",")):
            reps = []
            for _ in range(args.repeats):
                cmd = [sys.executable, __file__, "--one", op, str(tokens), "--member", args.member]
                cmd += ["--home", args.home] if args.home else []
                done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
                reps.append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = {"op": op, "tokens": tokens, "kv_bytes": reps[0]["kv_bytes"], "repeats": reps,
                   "median_peak_bytes": statistics.median(r["peak_bytes"] for r in reps),
                   "median_factor": statistics.median(r["factor"] for r in reps),
                   "max_factor": max(r["factor"] for r in reps)}
            rows.append(row)
            print(f"{op} {tokens}: factor median {row['median_factor']:.2f}, max {row['max_factor']:.2f}", flush=True)
    command = "python benchmarks/build_memory.py " + " ".join(sys.argv[1:])
    result = {"command": command, "machine": machine_info("cpu").model_dump(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "build_memory.json", json.dumps(result, indent=1))
    write_atomic(args.out / "build_memory.md", markdown(rows, command))


if __name__ == "__main__":
    main()
