"""Start-up cost of naming a model outside the family: resolving it and fingerprinting it, per process.

A pipeline whose ``models:`` names a local folder (or a Hub id) needs the model's fingerprint before
anything loads: it keys every mapping and cache entry. Before `orchestra.models.fpcache`, every new process
hashed the folder's tensors again (the in-process memo died with the process); now the weights digest
is computed once and kept beside the folder, and a Hugging Face snapshot's is read from the Hub
cache's blob hashes without reading a tensor.

For each tree given (a git revision checked out into a temporary worktree, or WORKTREE), fresh
interpreters time ``ModelRegistry({"m": <folder>}).info("m")`` (resolution + tokenizer + fingerprint;
imports are timed apart) on a folder of links to a bundled family member's files (so the member's
own folder is left alone). On the working tree the first process is the cold one (it writes the
cache file); the rest are warm. A hub-layout snapshot of the same files is timed too.

Writes ``benchmarks/results/startup.{json,md}``:
``python benchmarks/startup.py --rev ffcc0c4 --rev WORKTREE --repeats 5``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _revs import ROOT, remove_tree, run
from _revs import tree as checkout

RESULTS = ROOT / "benchmarks" / "results"

_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
from orchestra.models.registry import ModelRegistry
import transformers  # the import is the same before and after: timed apart from the fingerprint
t1 = time.perf_counter()
info = ModelRegistry({"m": sys.argv[1]}).info("m")
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "info_s": t2 - t1, "fingerprint": info.fingerprint}))
"""


def _linked_copy(member: Path, where: Path) -> Path:
    where.mkdir(parents=True)
    for f in member.iterdir():
        if f.is_file():
            (where / f.name).symlink_to(f)
    return where


def _hub_snapshot(member: Path, cache: Path, repo: str = "bench/startup") -> Path:
    """The member's files laid out as huggingface_hub's cache does: blobs named by their hash, linked from a snapshot."""
    import hashlib

    base = cache / f"models--{repo.replace('/', '--')}"
    blobs, commit = base / "blobs", "0" * 40
    snap = base / "snapshots" / commit
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    for f in member.iterdir():
        if not f.is_file():
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest() if f.suffix == ".safetensors" else \
            hashlib.sha1(f.read_bytes()).hexdigest()
        if not (blobs / digest).exists():
            shutil.copyfile(f, blobs / digest)
        (snap / f.name).symlink_to(Path("../../blobs") / digest)
    return snap


def _probe(tree: Path, target: str, env: dict[str, str]) -> dict[str, float | str]:
    out = run([sys.executable, "-c", _PROBE, target], env={**env, "PYTHONPATH": str(tree)}, cwd=str(tree))
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _row(name: str, runs: list[dict[str, float | str]]) -> dict[str, object]:
    info = [float(r["info_s"]) for r in runs]
    imports = [float(r["import_s"]) for r in runs]
    return {"case": name, "runs": len(runs), "info_s_median": statistics.median(info), "info_s_min": min(info),
            "info_s_max": max(info), "import_s_median": statistics.median(imports),
            "fingerprints": sorted({str(r["fingerprint"]) for r in runs})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", action="append", help="git revision or WORKTREE (repeatable; default WORKTREE)")
    parser.add_argument("--member", default="finetuned", help="bundled family member whose files are timed")
    parser.add_argument("--repeats", type=int, default=5, help="warm processes per case")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    revs = args.rev or ["WORKTREE"]

    from orchestra.family import load_family
    from orchestra.paths import default_home

    member = Path(load_family(default_home()).member(args.member).path)
    weights = sum(f.stat().st_size for f in member.glob("*.safetensors"))
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="orchestra-startup-") as tmp:
        scratch = Path(tmp)
        env = {**os.environ, "HOME": str(scratch / "home"), "ORCHESTRA_HOME": str(scratch / "orchestra-home"),
               "HF_HUB_CACHE": str(scratch / "hub"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        for rev in revs:
            tree = checkout(rev, scratch)
            folder = _linked_copy(member, scratch / f"folder-{rev}")
            first = _probe(tree, str(folder), env)
            warm = [_probe(tree, str(folder), env) for _ in range(args.repeats)]
            rows.append(_row(f"{rev}: folder, first process", [first]))
            rows.append(_row(f"{rev}: folder, later processes", warm))
        snap = _hub_snapshot(member, scratch / "hub")
        hub = [_probe(ROOT, "bench/startup", env) for _ in range(args.repeats)]
        rows.append(_row("WORKTREE: Hub id from an offline cache", hub))
        by_path = [_probe(ROOT, str(snap), env) for _ in range(2)]
        rows.append(_row("WORKTREE: the same snapshot by path", by_path))
        for rev in revs:
            if rev != "WORKTREE":
                remove_tree(scratch / f"tree-{rev}")

    import time

    from mappings.fingerprint import weights_digest_dir
    from orchestra.bench import machine_info

    t0 = time.perf_counter()
    weights_digest_dir(member)  # the work the cache file saves each later process, here once in this process
    hash_s = time.perf_counter() - t0
    result = {"member": args.member, "weights_bytes": weights, "hash_s": hash_s,
              "hash_mb_per_s": weights / 2**20 / hash_s, "machine": machine_info().model_dump(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    tmp_json = args.out / "startup.json.tmp"
    tmp_json.write_text(json.dumps(result, indent=2) + "\n")
    tmp_json.replace(args.out / "startup.json")
    lines = [f"# Start-up: resolving and fingerprinting a model folder ({args.member}, "
             f"{weights / 2**20:.0f} MiB of safetensors) in a fresh process", "",
             "| case | processes | info() median s | min s | max s | imports median s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['runs']} | {r['info_s_median']:.3f} | {r['info_s_min']:.3f} | "
                     f"{r['info_s_max']:.3f} | {r['import_s_median']:.3f} |")
    lines += ["", "`info()` = resolve the reference, load the tokenizer, fingerprint the model (config, weights, "
              "tokenizer); most of what remains after the cache is transformers' lazy imports of the model's "
              "config and tokenizer classes (imports of `orchestra.models.registry` and `transformers` are timed apart). "
              f"Hashing the {weights / 2**20:.0f} MiB of tensors, the work the cache file saves each later process, "
              f"took {hash_s:.2f} s here ({weights / 2**20 / hash_s:.0f} MiB/s): it grows with the weights (a 7B "
              "checkpoint in bf16 is ~14,000 MiB), the cached path does not.",
              "", "Rerun: `python benchmarks/startup.py " + " ".join(f"--rev {r}" for r in revs) + "`."]
    tmp_md = args.out / "startup.md.tmp"
    tmp_md.write_text("\n".join(lines) + "\n")
    tmp_md.replace(args.out / "startup.md")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
