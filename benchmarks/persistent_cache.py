"""Cold vs disk-warm vs memory-warm: what the disk tier saves a later process, and the demo run twice.

    python benchmarks/persistent_cache.py [--lengths 1024,4096,8000] [--members root,finetuned] [--skip-demo]

Per length, on the bundled family, each member's time to first token over the document (the cache
obtained, copied for the agent as agents copy it, one token decoded) three ways:

- *cold*: a fresh FamilyCache over an empty disk store (the root prefills; the mapped member is seeded on
  the root and mapped, as a cold run does);
- *disk-warm*: another fresh FamilyCache over the same store (what a later process finds: memory empty,
  the first one's caches on disk);
- *memory-warm*: the same request again on that FamilyCache (the entry is in memory).

The root's prefill of the same tokens is timed once more in the same process as the ratio's baseline.
Then, unless --skip-demo, `orchestra run` on the demo pipeline and document twice in two processes sharing
one fresh store: the second run's document prefill and disk-read seconds against the first one's prefill.
Writes results/persistent_cache.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _document_ids(fam: Any, length: int) -> list[int]:
    from orchestra.documents.texts import data_text

    text = "\n\n".join(data_text(name) for name in ("gpl-3.txt", "apache-2.0.txt", "mpl-2.0.txt"))
    ids = fam.loaded("root").tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        raise SystemExit(f"the texts hold {len(ids)} tokens, fewer than {length}")
    return list(ids[:length])


def _ttft(cache: Any, member: str, ids: list[int]) -> dict[str, Any]:
    """Acquire, copy as an agent does, decode one token: seconds of each and where the cache came from."""
    import torch

    from mappings.cache_io import copy_cache, forward_with_cache

    t0 = time.perf_counter()
    lease = cache.acquire_sync(member, ids)
    acquired = time.perf_counter() - t0
    model = cache.executor.model(member)
    with torch.no_grad(), cache.lock(member):
        private = copy_cache(lease.cache, model.model)
        forward_with_cache(model.model, torch.tensor([[ids[-1]]]), private, logits_to_keep=1)
    total = time.perf_counter() - t0
    out = {"ttft_s": total, "acquire_s": acquired, "path": lease.path, "hit": lease.hit,
           "loaded_tokens": lease.loaded_tokens, "load_s": lease.load_seconds, "prefill_s": lease.prefill_seconds,
           "map_s": lease.map_seconds, "steps": [s.step for s in lease.steps]}
    lease.release()
    return out


def measure(fam: Any, members: list[str], length: int, store_dir: Path) -> list[dict[str, Any]]:
    from orchestra.familycache import CachePolicy, FamilyCache, KVStore

    ids = _document_ids(fam, length)

    def fresh() -> Any:
        return FamilyCache(fam.registry, fam.store, source="root", policy=CachePolicy(budget_bytes=6 << 30),
                           disk=KVStore(store_dir, 16 << 30))

    rows = []
    cold_cache = fresh()
    cold = {m: _ttft(cold_cache, m, ids) for m in members}
    assert cold_cache.flush(600)
    cold_cache.clear()
    del cold_cache
    warm_cache = fresh()
    disk = {m: _ttft(warm_cache, m, ids) for m in members}
    memory = {m: _ttft(warm_cache, m, ids) for m in members}
    baseline_cache = FamilyCache(fam.registry, fam.store, source="root", policy=CachePolicy(budget_bytes=6 << 30))
    lease = baseline_cache.acquire_sync("root", ids, reuse=False)
    prefill_s = lease.prefill_seconds
    lease.release()
    stored = {e.namespace.kind: e.nbytes for e in KVStore(store_dir).entries()}
    for m in members:
        rows.append({"member": m, "tokens": length, "root_prefill_s": prefill_s, "cold": cold[m], "disk": disk[m],
                     "memory": memory[m], "file_mb": stored.get("exact" if disk[m]["path"] == "exact" else "mapped",
                                                                0) / 2**20,
                     "prefill_over_load": prefill_s / disk[m]["load_s"] if disk[m]["load_s"] else None,
                     "cold_over_disk_ttft": cold[m]["ttft_s"] / disk[m]["ttft_s"]})
    warm_cache.clear()
    return rows


def demo_twice(home: str | None, workdir: Path) -> dict[str, Any]:
    """`orchestra run` of the demo pipeline twice, each in its own process, over one fresh store."""
    pipeline = ROOT / "examples/long_document_analysis/pipeline.yaml"
    document = ROOT / "examples/long_document_analysis/document.txt"
    env = {**os.environ, "ORCHESTRA_KV_STORE": str(workdir / "kv")}
    runs = []
    for i in (1, 2):
        report = workdir / f"run{i}.json"
        cmd = [sys.executable, "-m", "orchestra", "run", str(pipeline), "--document", str(document),
               "--report", str(report)] + (["--home", home] if home else [])
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode not in (0, 3):
            raise SystemExit(f"demo run {i} failed ({done.returncode}): {done.stderr[-2000:]}")
        r = json.loads(report.read_text())
        runs.append({"exit": done.returncode, "wall_s": wall, "seconds": r["seconds"],
                     "prefill_s_spent": r["prefill_s_spent"], "disk_loads": r.get("disk_loads", 0),
                     "disk_load_s": r.get("disk_load_s", 0.0), "document_tokens": r["document_tokens"],
                     "caches": [{k: c[k] for k in ("model", "path", "from_disk", "disk_load_s", "seconds")}
                                for c in r["caches"]],
                     "agents": {a["name"]: a["status"] for a in r["agents"]},
                     "outputs": {a["name"]: a["output"] for a in r["agents"]}})
    first, second = runs
    return {"runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
            "second_over_first_prefill": second["prefill_s_spent"] / first["prefill_s_spent"],
            "second_prefill_and_load_over_first_prefill":
                (second["prefill_s_spent"] + second["disk_load_s"]) / first["prefill_s_spent"],
            "same_outputs": first["outputs"] == second["outputs"],
            "wall_ratio": first["wall_s"] / second["wall_s"]}


def markdown(rows: list[dict[str, Any]], demo: dict[str, Any] | None, command: str, machine: str) -> str:
    lines = [
        "# The disk tier: cold vs disk-warm vs memory-warm", "",
        f"Command: `{command}`. Machine: {machine}. One process for the table; TTFT = obtain the document's cache, "
        "copy it as an agent does, decode one token. *cold*: empty memory and disk (the mapped member is seeded "
        "on the root and mapped); *disk*: a fresh FamilyCache over the store the cold one wrote (a later "
        "process); *memory*: the same request again. *prefill / load*: the root's prefill of the tokens (timed "
        "again in the same process) over the seconds reading the member's file.", "",
        "| member | tokens | cold TTFT s | path | disk TTFT s | read s | memory TTFT s | root prefill s "
        "| prefill / read | cold / disk TTFT | file MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['prefill_over_load']:.0f}x" if r["prefill_over_load"] else "-"
        lines.append(
            f"| {r['member']} | {r['tokens']} | {r['cold']['ttft_s']:.2f} | {r['disk']['path']} | "
            f"{r['disk']['ttft_s']:.3f} | {r['disk']['load_s']:.3f} | {r['memory']['ttft_s']:.3f} | "
            f"{r['root_prefill_s']:.2f} | {ratio} | {r['cold_over_disk_ttft']:.1f}x | {r['file_mb']:.0f} |")
    if demo is not None:
        first, second = demo["runs"]
        lines += [
            "", "## The demo run twice", "",
            "`orchestra run examples/long_document_analysis/pipeline.yaml --document .../document.txt`, two "
            "processes sharing one fresh store (`ORCHESTRA_KV_STORE`).", "",
            "| run | exit | wall s | run s | document prefill s | caches read from disk | read s |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, r in enumerate(demo["runs"], 1):
            lines.append(f"| {i} | {r['exit']} | {r['wall_s']:.1f} | {r['seconds']:.1f} | {r['prefill_s_spent']:.2f} | "
                         f"{r['disk_loads']} | {r['disk_load_s']:.2f} |")
        lines += ["", f"The second run's document prefill is {100 * demo['second_over_first_prefill']:.1f} % of the "
                  f"first's ({100 * demo['second_prefill_and_load_over_first_prefill']:.1f} % counting its disk "
                  f"reads); same agent outputs: {demo['same_outputs']}; caches of the second: "
                  + ", ".join(f"{c['model']} {c['path']}{' (disk)' if c['from_disk'] else ''}"
                              for c in second["caches"]) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    from _results import command_line, write_results

    from orchestra.bench import BenchFamily, machine_info

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,4096,8000")
    parser.add_argument("--members", default="root,finetuned")
    parser.add_argument("--home", default=None, help="family home (default: the bundled one)")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = parser.parse_args()

    fam = BenchFamily.bundled(args.home)
    members = [m.strip() for m in args.members.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in (int(n) for n in args.lengths.split(",")):
            rows += measure(fam, members, length, Path(tmp) / f"kv{length}")
            print(json.dumps(rows[-len(members):], default=str)[:2000], flush=True)
        demo = None if args.skip_demo else demo_twice(args.home, Path(tmp))
    command = command_line("persistent_cache.py", None)
    machine = machine_info()
    text = f"{machine.cpu_model}, {machine.cpu_count} CPUs, torch {machine.torch}"
    write_results(args.out, "persistent_cache", {"command": command, "machine": machine.model_dump(), "rows": rows,
                                                 "demo": demo}, markdown(rows, demo, command, text))


if __name__ == "__main__":
    main()
