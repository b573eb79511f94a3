"""The demo pipeline on a family made only of what users have: a Hub id, a base/instruct pair, adapters, int8.

    python benchmarks/own_family_pipeline.py [--work DIR] [--tokens 8192]

The family, built here from the bundled one (no hub is reachable from this machine, so the Hub model is
put in a Hugging Face cache in the Hub's layout and read with ``HF_HUB_OFFLINE=1``):

- ``instruct``: ``HuggingFaceTB/SmolLM2-135M-Instruct`` named by Hub id (the bundled root's files in the
  cache); the source: the document is prefilled on it once;
- ``base``: a folder holding another checkpoint of the family (the bundled fine-tuned sibling's weights)
  with a base checkpoint's special tokens (bos/eos/pad ``<|endoftext|>`` where the instruct has
  ``<|im_start|>``/``<|im_end|>``), its chat template kept as Qwen2.5's base checkpoints keep theirs;
- ``tuned``, ``all``, ``upper``, ``top``: peft LoRA adapter folders over ``instruct`` (the shipped
  docstrings delta, and three made with peft over every layer, the upper half, the top quarter);
- ``int8``: a torchao int8 weight-only view of ``instruct`` (``pip install 'orchestra-kv[quant]'``).

Steps, each a CLI command as a user types it: ``orchestra family init ... --calibrate`` (fits
instruct -> base), then ``orchestra run`` of the long-document demo's agents (plus one per other
adapter) over the demo document with ``--report``. The other maps are calibrated on demand by the run
(``mapping.on_missing: calibrate``). Memory of instruct + the 4 adapters is measured in-process.
Writes ``benchmarks/results/own_family_pipeline.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python benchmarks/...`: `tests.fixtures` is importable
RESULTS = ROOT / "benchmarks" / "results"
DEMO = ROOT / "examples" / "long_document_analysis"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
ADAPTERS = ("tuned", "all", "upper", "top")


def _base_folder(weights_from: Path, tokenizer_from: Path, out: Path) -> Path:
    """A model folder: `weights_from`'s config and weights, `tokenizer_from`'s tokenizer with a base checkpoint's
    special tokens (the token ids of every text stay the same: only the roles differ)."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for f in weights_from.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy2(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_from), bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    tok.save_pretrained(str(out))
    return out


def _pipeline(adapters: dict[str, Path], tokens: int) -> dict[str, Any]:
    """The demo's five agents on this family's members, plus one agent for each adapter they leave out."""
    import yaml

    demo = yaml.safe_load((DEMO / "pipeline.yaml").read_text())
    members = {"root": "instruct", "tuned": "tuned", "int8": "int8", "small": "base"}
    agents = []
    for agent in demo["agents"]:
        agents.append(agent | {"model": members[agent["model"]]})
    agents += [
        {"name": "obligations", "model": "all", "builtin": "question_answerer",
         "args": {"question": "What must you do when you convey a copy of the Program?", "max_new_tokens": 48}},
        {"name": "headline", "model": "upper", "builtin": "summarizer", "args": {"max_words": 30, "max_new_tokens": 48}},
        {"name": "terms", "model": "top", "builtin": "key_facts", "args": {"max_facts": 3, "max_new_tokens": 96}},
    ]
    models: dict[str, Any] = {"instruct": "instruct", "base": "base", "int8": {"base": "instruct", "quantize": "int8"}}
    models |= {name: {"adapter": str(path), "base": "instruct"} for name, path in adapters.items()}
    return {"name": "long-document-analysis-own-family", "models": models, "source": "instruct",
            "default_device": "auto", "agents": agents, "gate": demo["gate"],
            "mapping": {"on_missing": "calibrate", "tokens": tokens}}


def _run(cmd: list[str], env: dict[str, str], log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - t0


def _memory(home: Path, adapters: dict[str, Path], env: dict[str, str]) -> dict[str, int]:
    """instruct alone, instruct + 4 adapters as members, and what 5 merged copies would hold (in-process)."""
    from orchestra.family import load_family
    from orchestra.models.modelref import AdapterSpec
    from orchestra.models.registry import ModelRegistry
    from tests.fixtures.adapters import distinct_bytes

    saved = {k: os.environ.get(k) for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    os.environ.update({k: env[k] for k in saved})
    try:
        family = load_family(home)
        aliases: dict[str, str | AdapterSpec] = {"instruct": "instruct"}
        aliases |= {n: AdapterSpec(str(p), "instruct") for n, p in adapters.items()}
        registry = ModelRegistry(aliases, family=family, default_device="cpu")
        root = registry.load("instruct")
        members = [registry.load(n).model for n in adapters]
        one = distinct_bytes(root.model)
        return {"one_model_bytes": one, "with_adapters_bytes": distinct_bytes(root.model, *members),
                "merged_copies_bytes": one * (1 + len(adapters))}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="working folder (default: a temporary one, removed after)")
    parser.add_argument("--tokens", type=int, default=8192, help="calibration tokens per map")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import yaml

    from orchestra.bench import machine_info
    from orchestra.family import load_family
    from orchestra.paths import default_home
    from tests.fixtures.adapters import make_lora_adapter
    from tests.fixtures.hubcache import hub_repo

    bundled = load_family(default_home())
    root_dir, tuned_dir = Path(bundled.member("root").path), Path(bundled.member("finetuned").path)
    work = args.work or Path(tempfile.mkdtemp(prefix="orchestra-own-family-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "commands.log"
    hub, home = work / "hub", work / "home"
    for stale in (hub, home, work / "base", work / "adapters"):
        shutil.rmtree(stale, ignore_errors=True)
    hub_repo(hub, HUB_ID, root_dir)
    base = _base_folder(tuned_dir, root_dir, work / "base")
    adapters = {
        "tuned": ROOT / "orchestra" / "family" / "deltas" / "finetuned",
        "all": make_lora_adapter(root_dir, work / "adapters" / "all", seed=1),
        "upper": make_lora_adapter(root_dir, work / "adapters" / "upper", layers=range(15, 30), seed=2),
        "top": make_lora_adapter(root_dir, work / "adapters" / "top", layers=range(24, 30),
                                 targets=["q_proj", "v_proj"], seed=3),
    }
    pipeline = work / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(_pipeline(adapters, args.tokens), sort_keys=False))
    env = os.environ | {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "ORCHESTRA_HOME": str(home)}

    orchestra = [sys.executable, "-m", "orchestra"]
    init_cmd = [*orchestra, "family", "init", "own", f"instruct={HUB_ID}", f"base={base}", "--home", str(home),
                "--calibrate", "--tokens", str(args.tokens)]
    init_s = _run(init_cmd, env, log)
    report_path = work / "report.json"
    run_cmd = [*orchestra, "run", str(pipeline), "--document", str(DEMO / "document.txt"), "--home", str(home),
               "--report", str(report_path)]
    run_s = _run(run_cmd, env, log)
    report = json.loads(report_path.read_text())
    manifest = json.loads((home / "family" / "family.json").read_text())
    result = {
        "machine": machine_info().model_dump(), "args": {"tokens": args.tokens},
        "commands": {name: " ".join(cmd[3:]).replace(str(work), "$WORK").replace(str(ROOT) + "/", "")
                     for name, cmd in (("init", init_cmd), ("run", run_cmd))},
        "init_s": init_s, "run_s": run_s,
        "members": {name: {"kind": rec.get("made_by", {}).get("kind"), "reference": rec.get("made_by", {}).get(
            "reference", "").replace(str(work), "$WORK"), "role": rec.get("role")}
            for name, rec in manifest["members"].items()},
        "pipeline": yaml.safe_load(pipeline.read_text()),
        "report": {k: report[k] for k in ("document_tokens", "seconds", "prefill_s_spent", "prefill_s_saved",
                                          "warnings")},
        "caches": report["caches"],
        "agents": [{k: a.get(k) for k in ("name", "model", "status", "cache_path", "fallback_reason", "gate",
                                          "prefill_s_spent", "prefill_s_saved", "output")} for a in report["agents"]],
        "memory": _memory(home, adapters, env),
    }
    source = result["pipeline"]["source"]
    result["all_non_source_mapped_or_exact"] = all(
        a["status"] == "succeeded" and a["cache_path"] in ("mapped", "exact")
        for a in result["agents"] if a["model"] != source)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in (("own_family_pipeline.json", json.dumps(result, indent=2, default=str) + "\n"),
                       ("own_family_pipeline.md", render(result))):
        tmp = args.out / f"{name}.tmp"
        tmp.write_text(text)
        tmp.replace(args.out / name)
    print(render(result))


def _gates(gates: list[dict[str, Any]]) -> str:
    return ", ".join(f"{g.get('gate')}={'pass' if g.get('passed') else 'fail'}" for g in gates) or "-"


def render(result: dict[str, Any]) -> str:
    mib = 2**20
    mem = result["memory"]
    m = result["machine"]
    lines = [
        "# The demo pipeline on an own family (Hub id, base/instruct pair, LoRA adapters, int8 view; CPU)", "",
        "Command: `python benchmarks/own_family_pipeline.py`, which runs, as a user would "
        "(`HF_HUB_OFFLINE=1`, a Hub cache in the Hub's layout):", "",
        f"```bash\norchestra {result['commands']['init']}\norchestra {result['commands']['run']}\n```", "",
        f"Machine: {m['cpu_model']} ({m['cpu_count']} CPUs), torch {m['torch']}. `family init --calibrate` "
        f"{result['init_s']:.0f} s; `run` {result['run_s']:.0f} s (adapter and int8 maps calibrated on demand: "
        f"{result['args']['tokens']} tokens each).", "",
        "## Members", "", "| member | named by | role |", "|---|---|---|",
    ]
    for name, rec in result["members"].items():
        lines.append(f"| {name} | {rec['kind']}: `{rec['reference']}` | {rec['role']} |")
    for name, spec in result["pipeline"]["models"].items():
        if isinstance(spec, dict):
            what = (f"LoRA adapter `{Path(spec['adapter']).name}` over {spec['base']}" if "adapter" in spec
                    else f"{spec['quantize']} view of {spec['base']} (torchao)")
            lines.append(f"| {name} | {what} | member |")
    lines += ["", "`base` holds the bundled fine-tuned sibling's weights with a base checkpoint's special tokens "
              "(bos/eos/pad `<|endoftext|>`; the instruct's are `<|im_start|>`/`<|im_end|>`): the SmolLM2-135M base "
              "checkpoint itself is not on this machine. `tuned` is the docstrings delta shipped in "
              "`orchestra/family/deltas/finetuned`; `all`, `upper`, `top` are made with peft (random B factors).", "",
              f"## Agents ({result['report']['document_tokens']}-token document)", "",
              "| agent | member | status | cache | gates | prefill s saved |", "|---|---|---|---|---|---:|"]
    for a in result["agents"]:
        lines.append(f"| {a['name']} | {a['model']} | {a['status']} | {a['cache_path']} | {_gates(a['gate'])} | "
                     f"{a['prefill_s_saved']:.2f} |")
    r = result["report"]
    lines += ["", f"Every agent off the source on a mapped or exact cache: **{result['all_non_source_mapped_or_exact']}**. "
              f"Prefill seconds spent {r['prefill_s_spent']:.2f}, saved {r['prefill_s_saved']:.2f}.", "",
              "## Memory (instruct + 4 adapters as members)", "", "| | bytes | x one model |", "|---|---:|---:|",
              f"| instruct alone | {mem['one_model_bytes'] / mib:,.1f} MiB | 1.00 |",
              f"| instruct + 4 adapters | {mem['with_adapters_bytes'] / mib:,.1f} MiB | "
              f"{mem['with_adapters_bytes'] / mem['one_model_bytes']:.3f} |",
              f"| 5 merged copies | {mem['merged_copies_bytes'] / mib:,.1f} MiB | "
              f"{mem['merged_copies_bytes'] / mem['one_model_bytes']:.2f} |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
