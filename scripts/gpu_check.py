"""GPU check: the evaluate table and the demo pipeline on CUDA devices, local and on the ray executor.

    python scripts/gpu_check.py [--out DIR] [--no-ray] [--prefix-tokens N] [--budget-s S]

For the times a GPU machine is available (see scripts/gpu_check.sh). Steps, each a subprocess with its
log kept under --out:

0. prepare (not counted in the budget): `orchestra family build` and `orchestra family calibrate`,
   which reuse what exists;
1. `orchestra evaluate` for every root -> member mapping, member k on ``cuda:(k mod N)`` (N visible
   devices), on the held-out GPL-3 text: evaluate_<role>.json;
2. the demo pipeline (examples/long_document_analysis) with one device per member (``devices:``
   round-robin over the N devices): demo_local.json;
3. unless --no-ray or Ray is missing, the same pipeline with ``executor: ray``, each member's actor
   reserving 1 GPU (or an equal share when there are fewer GPUs than members): demo_ray.json;
4. unless --no-own-family, a family of one's own on cuda:0 with ``dtype: auto`` (bfloat16): the root, the
   shipped fine-tune delta and an upper-half LoRA adapter as adapter members, and torchao ``int8`` and
   ``int4`` views of the root; one agent per member: own_family.json (each agent's cache path).

Writes gpu_check.json and gpu_check.md: devices, seconds per step, the evaluate summary (KL, top-1
per member and method), each agent's cache path and output, and whether the ray run's outputs and
cache paths equal the local run's. Exit 0 when every step ran and the two runs agree, 1 otherwise,
2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python scripts/gpu_check.py`: `tests.fixtures` is importable
DEMO = ROOT / "examples" / "long_document_analysis"
HELD_OUT = ROOT / "orchestra" / "family" / "data" / "gpl-3.txt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    parser.add_argument("--no-ray", action="store_true", help="skip the ray executor run")
    parser.add_argument("--no-own-family", action="store_true", help="skip the adapters / quantized views run")
    parser.add_argument("--prefix-tokens", type=int, default=3584)
    parser.add_argument("--budget-s", type=float, default=300.0, help="time limit of the checks (steps 1-3)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    n = torch.cuda.device_count()
    devices = [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(n)]
    args.out.mkdir(parents=True, exist_ok=True)
    steps: list[dict[str, Any]] = []
    deadline = [0.0]

    def step(name: str, cmd: list[str], budgeted: bool = True) -> bool:
        left = max(1.0, deadline[0] - time.monotonic()) if budgeted else None
        log = args.out / f"{name}.log"
        print("+", shlex.join(cmd), flush=True)
        t0 = time.monotonic()
        try:
            with log.open("w") as fh:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        steps.append({"step": name, "command": shlex.join(cmd), "rc": rc, "seconds": round(time.monotonic() - t0, 2),
                      "log": log.name})
        if rc != 0:
            print(f"  {name} failed (rc {rc}); see {log}", file=sys.stderr)
        return rc == 0

    step("prepare_build", ["orchestra", "family", "build"], budgeted=False)
    step("prepare_calibrate", ["orchestra", "family", "calibrate"], budgeted=False)
    deadline[0] = time.monotonic() + args.budget_s

    from orchestra.family import load_family

    family = load_family()
    root = family.member("root")
    store = Path(family.home) / "mappings"
    evaluate: dict[str, Any] = {}
    members = [m for m in family.members.values() if m.role != "root"]
    for k, member in enumerate(members):
        found = sorted(store.glob(f"{root.name}__to__{member.name}__*"))
        if not found:
            steps.append({"step": f"evaluate_{member.role}", "rc": 2, "error": f"no mapping in {store}"})
            continue
        out_json = args.out / f"evaluate_{member.role}.json"
        if step(f"evaluate_{member.role}", [
            "orchestra", "evaluate", "--mapping", str(found[-1]), "--source", str(family.member_path(root.name)),
            "--target", str(family.member_path(member.name)), "--document", str(HELD_OUT),
            "--prefix-tokens", str(args.prefix_tokens), "--suffix-tokens", "32", "--windows", "2",
            "--tail-tokens", "64", "--repair", "0.1", "--device", f"cuda:{(k + 1) % n}", "--json", str(out_json),
        ]):
            report = json.loads(out_json.read_text())
            evaluate[member.role] = {"device": f"cuda:{(k + 1) % n}", "mapping_method": report["mapping_method"],
                                     "methods": {r["method"]: {"kl": r["kl"], "top1": r["top1"]}
                                                 for r in report["methods"]}}

    import yaml

    spec = yaml.safe_load((DEMO / "pipeline.yaml").read_text())
    aliases = list(spec["models"])
    spec["devices"] = {alias: f"cuda:{i % n}" for i, alias in enumerate(aliases)}
    spec["default_device"] = "cuda:0"
    local_yaml = args.out / "pipeline_local.yaml"
    local_yaml.write_text(yaml.safe_dump(spec, sort_keys=False))
    runs: dict[str, Any] = {}
    if step("demo_local", ["orchestra", "run", str(local_yaml), "--document", str(DEMO / "document.txt"),
                           "--report", str(args.out / "demo_local.json")]):
        runs["local"] = json.loads((args.out / "demo_local.json").read_text())

    try:
        import ray  # noqa: F401

        have_ray = True
    except ImportError:
        have_ray = False
    if not args.no_ray and have_ray:
        share = 1.0 if n >= len(aliases) else round(n / len(aliases), 2)
        ray_spec = dict(spec, devices={}, default_device="auto",
                        executor={"kind": "ray", "num_cpus": 1, "members": {a: {"num_gpus": share} for a in aliases}})
        ray_yaml = args.out / "pipeline_ray.yaml"
        ray_yaml.write_text(yaml.safe_dump(ray_spec, sort_keys=False))
        if step("demo_ray", ["orchestra", "run", str(ray_yaml), "--document", str(DEMO / "document.txt"),
                             "--report", str(args.out / "demo_ray.json")]):
            runs["ray"] = json.loads((args.out / "demo_ray.json").read_text())

    if not args.no_own_family:
        own = _own_family_pipeline(args.out, Path(family.member_path("root")))
        if step("own_family", ["orchestra", "run", str(own), "--document", str(DEMO / "document.txt"),
                               "--report", str(args.out / "own_family.json")]):
            runs["own_family"] = json.loads((args.out / "own_family.json").read_text())

    agree = None
    if "local" in runs and "ray" in runs:
        agree = ([(a["output"], a["cache_path"]) for a in runs["local"]["agents"]]
                 == [(a["output"], a["cache_path"]) for a in runs["ray"]["agents"]])
    summary = {"devices": devices, "torch": torch.__version__, "budget_s": args.budget_s, "steps": steps,
               "evaluate": evaluate, "ray_matches_local": agree,
               "runs": {k: {"seconds": r["seconds"], "executor": r.get("executor"),
                            "kv_bytes_moved": r.get("kv_bytes_moved", 0),
                            "agents": [{k2: a.get(k2) for k2 in ("name", "model", "status", "cache_path", "actor",
                                                                  "node", "ttft_s", "output")} for a in r["agents"]]}
                        for k, r in runs.items()},
               "member_devices": spec["devices"]}
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    (args.out / "gpu_check.md").write_text(_markdown(summary))
    print(f"wrote {args.out / 'gpu_check.md'}")
    ok = all(s["rc"] == 0 for s in steps) and agree is not False
    return 0 if ok else 1


def _own_family_pipeline(out: Path, root: Path) -> Path:
    """The pipeline of step 4 (an upper-half LoRA adapter over the root is made here with peft)."""
    import yaml

    from tests.fixtures.adapters import make_lora_adapter

    upper = make_lora_adapter(root, out / "lora_upper", layers=range(15, 30),
                              targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    models = {"root": "root", "tuned": {"adapter": str(ROOT / "orchestra/family/deltas/finetuned"), "base": "root"},
              "upper": {"adapter": str(upper), "base": "root"}, "int8": {"base": "root", "quantize": "int8"},
              "int4": {"base": "root", "quantize": "int4"}}
    spec = {"name": "own-family-gpu", "models": models, "source": "root", "default_device": "cuda:0", "dtype": "auto",
            "agents": [{"name": f"on_{m}", "model": m, "builtin": "summarizer"} for m in models]}
    path = out / "pipeline_own_family.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _markdown(s: dict[str, Any]) -> str:
    lines = ["# GPU check", "", f"Devices: {', '.join(s['devices'])}; torch {s['torch']}. "
             f"Members on devices: {s['member_devices']}.", "", "| step | rc | seconds |", "|---|---|---|"]
    lines += [f"| {st['step']} | {st['rc']} | {st.get('seconds', '-')} |" for st in s["steps"]]
    lines += ["", "## evaluate (held-out GPL-3)", "", "| member | device | method | KL | top-1 |", "|---|---|---|---|---|"]
    for role, ev in s["evaluate"].items():
        for method, m in ev["methods"].items():
            lines.append(f"| {role} | {ev['device']} | {method} | {m['kl']:.4f} | {m['top1']:.3f} |")
    for name, run in s["runs"].items():
        lines += ["", f"## demo pipeline, {name} executor: {run['seconds']:.1f} s, K/V moved "
                  f"{run['kv_bytes_moved'] / 2**20:.1f} MiB", "", "| agent | model | status | cache | actor | TTFT s |",
                  "|---|---|---|---|---|---|"]
        for a in run["agents"]:
            ttft = "-" if a["ttft_s"] is None else f"{a['ttft_s']:.2f}"
            lines.append(f"| {a['name']} | {a['model']} | {a['status']} | {a['cache_path']} | {a['actor'] or '-'} | {ttft} |")
    if s["ray_matches_local"] is not None:
        lines += ["", f"Ray outputs and cache paths equal the local run's: **{s['ray_matches_local']}**."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
