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
   ``int4`` views of the root; one agent per member: own_family.json (each agent's cache path);
5. unless --no-vllm, with ``vllm`` importable in --vllm-python (default: this interpreter; else both steps
   are recorded as skipped, with the reason, not failed), under a budget of their own (--vllm-budget-s):
   ``vllm_connector``, the connector's tests against real CUDA engines
   (``ORCHESTRA_VLLM_TESTS=1 python -m pytest -q tests/vllm -p no:cacheprovider -x``), and
   ``vllm_family_bench``, ``benchmarks/vllm_family.py --out <out>/vllm`` (the same agents three ways:
   orchestra, orchestra on vLLM, LangGraph on plain vLLM): vllm/vllm_family.json and .md.

Writes gpu_check.json and gpu_check.md: devices, seconds per step, the evaluate summary (KL, top-1
per member and method), each agent's cache path and output, and whether the ray run's outputs and
cache paths equal the local run's, and the vLLM steps' pass / fail / skip with the benchmark's wall time,
document tokens computed and decode rate per way. Exit 0 when every step that was not skipped passed and
the two runs agree, 1 otherwise, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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
    parser.add_argument("--budget-s", type=float, default=300.0, help="time limit of the checks (steps 1-4)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM steps (step 5)")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="the interpreter with vllm and orchestra installed (docs/vllm.md: a venv of its own)")
    parser.add_argument("--vllm-budget-s", type=float, default=1800.0, help="time limit of the vLLM steps together")
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

    def step(name: str, cmd: list[str], budgeted: bool = True, env: dict[str, str] | None = None) -> bool:
        left = max(1.0, deadline[0] - time.monotonic()) if budgeted else None
        log = args.out / f"{name}.log"
        print("+", shlex.join(cmd), flush=True)
        t0 = time.monotonic()
        rc = run_logged(cmd, log, left, env)
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

    vllm = None if args.no_vllm else _vllm_steps(step, steps, args.out, args.vllm_python, args.vllm_budget_s, deadline)

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
               "member_devices": spec["devices"], "vllm": vllm}
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    (args.out / "gpu_check.md").write_text(_markdown(summary))
    print(f"wrote {args.out / 'gpu_check.md'}")
    ok = all(s["rc"] == 0 or s.get("skipped") for s in steps) and agree is not False
    return 0 if ok else 1


def run_logged(cmd: list[str], log: Path, timeout: float | None, env: dict[str, str] | None = None) -> int:
    """`cmd`'s exit status, its output in `log`; 124 when it ran past `timeout` s. It runs in a session of its
    own, so that one out of time is stopped together with the processes it started (vLLM's workers)."""
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            return 124
        except BaseException:  # Ctrl-C reaches this process only: stop the step's session too
            _kill_session(proc)
            raise


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


VLLM_STEPS = ("vllm_connector", "vllm_family_bench")
VLLM_WAYS = ("orchestra", "orchestra_vllm", "langgraph_vllm")
"""The vLLM steps, and the benchmark's ways in its order (orchestra's own engine, orchestra on vLLM, LangGraph on
plain vLLM)."""


def vllm_skip_reason(python: str) -> tuple[str | None, str | None]:
    """``(reason to skip the vLLM steps, vLLM's version)``: a reason when ``import vllm`` fails in `python`."""
    try:
        done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                              timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run `{python} -c 'import vllm'`: {exc}", None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return (f"`import vllm` fails in {python} ({last}): pip install -e '.[vllm]' there, or name that "
                "interpreter with --vllm-python"), None
    return None, (done.stdout.strip().splitlines() or ["?"])[-1]


def vllm_headline(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per way of a benchmarks/vllm_family.py report: wall s, document tokens computed and decode tokens/s."""
    runs = report.get("runs", {})
    return {way: {key: runs[way].get(key) for key in ("wall_s", "document_tokens_computed", "decode_tokens_per_s")}
            for way in [*[w for w in VLLM_WAYS if w in runs], *[w for w in runs if w not in VLLM_WAYS]]}


def _vllm_steps(step: Callable[..., bool], steps: list[dict[str, Any]], out: Path, python: str, budget_s: float,
                deadline: list[float]) -> dict[str, Any]:
    """Step 5 (`step` runs one step, `steps` records them); the summary's ``vllm`` entry."""
    if os.sep in python:  # a path: the same interpreter from the steps' folder (not resolved: a venv's is a link)
        python = str(Path(python).absolute())
    reason, version = vllm_skip_reason(python)
    result: dict[str, Any] = {"python": python, "version": version, "skipped": reason, "steps": {}, "bench": None}
    if reason is not None:
        print(f"gpu_check: vLLM steps skipped: {reason}", file=sys.stderr)
        for name in VLLM_STEPS:
            steps.append({"step": name, "rc": None, "skipped": reason})
            result["steps"][name] = "skip"
        return result
    deadline[0] = time.monotonic() + budget_s
    passed = step("vllm_connector", [python, "-m", "pytest", "-q", "tests/vllm", "-p", "no:cacheprovider", "-x"],
                  env={"ORCHESTRA_VLLM_TESTS": "1"})
    result["steps"]["vllm_connector"] = "pass" if passed else "fail"
    bench_out = out / "vllm"
    passed = step("vllm_family_bench", [python, "benchmarks/vllm_family.py", "--out", str(bench_out),
                                        "--name", "vllm_family"])
    result["steps"]["vllm_family_bench"] = "pass" if passed else "fail"
    report = bench_out / "vllm_family.json"
    if passed and report.exists():
        result["bench"] = {"report": str(report), "ways": vllm_headline(json.loads(report.read_text()))}
    return result


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
    lines += [f"| {st['step']} | {'skipped' if st.get('skipped') else st['rc']} | {st.get('seconds', '-')} |"
              for st in s["steps"]]
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
    if s.get("vllm") is not None:
        lines += vllm_markdown(s["vllm"])
    return "\n".join(lines) + "\n"


def vllm_markdown(v: dict[str, Any]) -> list[str]:
    """The summary's vLLM section (the ``vllm`` entry of gpu_check.json), as Markdown lines."""
    lines = ["", f"## vLLM ({v['python']}, vllm {v['version'] or '-'})", ""]
    if v["skipped"]:
        lines += [f"Skipped: {v['skipped']}.", ""]
    lines += [f"- {name}: **{status}**" for name, status in v["steps"].items()]
    if v.get("bench"):
        lines += ["", f"benchmarks/vllm_family.py ({v['bench']['report']}):", "",
                  "| way | wall s | document tokens computed | decode tokens/s |", "|---|---|---|---|"]
        lines += [f"| {way} | {h['wall_s']} | {h['document_tokens_computed']} | {h['decode_tokens_per_s']} |"
                  for way, h in v["bench"]["ways"].items()]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
