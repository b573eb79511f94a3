"""What building and decoding take in memory beside the K/V they hold: peak RSS of a prefill, a map, a reply's
join and a decoding step.

    python benchmarks/build_memory.py [--lengths 512,1024,2048,4096] [--repeats 3] [--member finetuned]
        [--ops prefill,map,join,step] [--rows 8]

Each measurement runs in a fresh process (so no allocator state is inherited) on the bundled family, CPU:
the model (and for a map, the source's cache) is made first; then RSS is sampled every 2 ms while the
operation runs. Factor = (peak RSS over the RSS before it) / (bytes of the K/V it returns). FamilyCache holds
`BUILD_MEMORY_FACTOR` times a build's K/V against the cache budget while it runs; this is where that number
comes from. A *join* is a reply's 64-token prompt tail run over its copy of the prefix, as the server's batch
decoder runs it before the row enters the batch (factor over the row's K/V: what a joining row holds beside
it); a *step* is one batched decoding step over `--rows` rows of `tokens` each, in the batch's `RoomLayer`
buffers (factor over the batch's K/V). Rows of earlier commands for other operations or lengths are kept.
Writes results/build_memory.json and .md.
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


def _measure_step(model: Any, ids: Any, rows: int) -> dict[str, Any]:
    """One batched decoding step over `rows` rows of `ids`' K/V, as the batch decoder runs it."""
    import gc

    import torch

    from mappings.cache_io import cache_layers, forward_with_cache
    from orchestra.serve import add_row

    _, one, _ = forward_with_cache(model, ids, None, logits_to_keep=1)
    batch = None
    for _ in range(rows):
        batch = add_row(batch, [(k.clone(), v.clone()) for k, v in cache_layers(one)])
    del one
    mask = torch.ones(rows, ids.shape[1] + 1, dtype=torch.long)
    mask[1:, 0] = 0  # rows of different lengths, as in the server: a padded batch decodes under a mask
    tokens = torch.full((rows, 1), int(ids[0, -1]), dtype=torch.long)
    positions = torch.full((rows, 1), ids.shape[1], dtype=torch.long)
    warm = add_row(None, [(k[:1, :, :32].clone(), v[:1, :, :32].clone()) for k, v in cache_layers(batch)])
    forward_with_cache(model, tokens[:1], warm, attention_mask=mask[:1, :33], position_ids=positions[:1] * 0 + 32,
                       logits_to_keep=1)  # the step's first-call set-up is not its working memory
    del warm
    gc.collect()
    kv = sum(k.nbytes + v.nbytes for k, v in cache_layers(batch))
    _, peak = _peak_during(lambda: forward_with_cache(model, tokens, batch, attention_mask=mask,
                                                       position_ids=positions, logits_to_keep=1))
    return {"op": "step", "tokens": ids.shape[1], "rows": rows, "kv_bytes": kv, "peak_bytes": peak,
            "factor": peak / kv}


def _measure_join(model: Any, ids: Any, tail: int) -> dict[str, Any]:
    """A reply's prompt tail (`tail` tokens) over its copy of a `ids`-long prefix, as the batch decoder joins it."""
    import gc

    from agents.kv import forward_tokens
    from mappings.cache_io import cache_layers, forward_with_cache
    from orchestra.serve import ROOM_CHUNK, room_cache

    prefix = ids[:, : ids.shape[1] - tail]
    new = ids[0, ids.shape[1] - tail:].tolist()
    _, one, _ = forward_with_cache(model, prefix, None, logits_to_keep=1)
    warm = room_cache([(k[..., :32, :], v[..., :32, :]) for k, v in cache_layers(one)], tail + ROOM_CHUNK)
    forward_tokens(model, new, warm, 32)  # first-call set-up
    del warm
    row = room_cache(cache_layers(one), tail + ROOM_CHUNK)
    del one
    gc.collect()
    kv = sum(k.nbytes + v.nbytes for k, v in cache_layers(row))
    _, peak = _peak_during(lambda: forward_tokens(model, new, row, prefix.shape[1]))
    return {"op": "join", "tokens": int(ids.shape[1]), "tail": tail, "kv_bytes": kv, "peak_bytes": peak,
            "factor": peak / kv}


def measure_one(op: str, tokens: int, member: str, home: str | None, rows: int = 8) -> dict[str, Any]:
    """In this process: one `op` ("prefill" on the root, "map" root -> member, or a decoding "step" over `rows`
    rows of the root's K/V) over `tokens` tokens."""
    import gc

    import torch

    from mappings.apply import map_cache
    from mappings.cache_io import cache_layers, forward_with_cache
    from orchestra.bench import BenchFamily, Pair
    from orchestra.documents.texts import data_text

    torch.set_grad_enabled(False)
    fam = BenchFamily.bundled(home)
    source = fam.loaded("root")
    text = data_text("gpl-3.txt") * 2
    ids = torch.tensor([source.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]])
    forward_with_cache(source.model, ids[:, :32], None, logits_to_keep=1)  # first-call set-up is not the build's
    if op == "step":
        return _measure_step(source.model, ids, rows)
    if op == "join":
        return _measure_join(source.model, ids, 64)
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
             f"Commands: {command}. Each repetition in a fresh process; peak RSS sampled every 2 ms during the "
             "operation, over the RSS just before it. Factor = peak / the K/V the operation returns (a join: the "
             "row's K/V; a step: the batch's, 8 rows); FamilyCache holds `BUILD_MEMORY_FACTOR` x a build's K/V "
             "against the cache budget while it runs; a joining row holds its tail pass's working memory.", "",
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
    parser.add_argument("--ops", default="prefill,map,join,step")
    parser.add_argument("--rows", type=int, default=8, help="rows in a decoding step's batch")
    parser.add_argument("--home", default=None, help="family home (default: the bundled one)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--one", nargs=2, metavar=("OP", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child: one measurement, as JSON on the last line
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.member, args.home, args.rows)))
        return

    from mappings.atomic import write_atomic
    from orchestra.bench import machine_info

    rows = []
    for op in args.ops.split(","):
        for tokens in (int(n) for n in args.lengths.split(",")):
            reps = []
            for _ in range(args.repeats):
                cmd = [sys.executable, __file__, "--one", op, str(tokens), "--member", args.member,
                       "--rows", str(args.rows)]
                cmd += ["--home", args.home] if args.home else []
                done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
                reps.append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = {"op": op, "tokens": tokens, "kv_bytes": reps[0]["kv_bytes"], "repeats": reps,
                   "median_peak_bytes": statistics.median(r["peak_bytes"] for r in reps),
                   "median_factor": statistics.median(r["factor"] for r in reps),
                   "max_factor": max(r["factor"] for r in reps)}
            rows.append(row)
            print(f"{op} {tokens}: factor median {row['median_factor']:.2f}, max {row['max_factor']:.2f}", flush=True)
    # rows of other operations or lengths, measured by earlier commands, are kept beside this run's
    path = args.out / "build_memory.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    commands = old.get("commands") or ([old["command"]] if "command" in old else [])
    commands.append("python benchmarks/build_memory.py " + " ".join(sys.argv[1:]))
    fresh = {(r["op"], r["tokens"]) for r in rows}
    order = {"prefill": 0, "map": 1, "join": 2, "step": 3}
    rows = sorted([r for r in old.get("rows", []) if (r["op"], r["tokens"]) not in fresh] + rows,
                  key=lambda r: (order.get(r["op"], 9), r["tokens"]))
    result = {"commands": commands, "machine": machine_info("cpu").model_dump(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(result, indent=1))
    write_atomic(args.out / "build_memory.md", markdown(rows, "; ".join(f"`{c}`" for c in commands)))


if __name__ == "__main__":
    main()
