"""The chat workload of `serve_load.py` on vLLM: orchestra on vLLM (the family connector) vs plain vLLM.

    python benchmarks/vllm_chat_load.py [--clients 8] [--doc-tokens 1800] [--max-tokens 16]

Run it in a venv with vLLM (docs/vllm.md) over a built family home (`orchestra family build`). The workload is
`serve_load.py`'s load phase: `--clients` conversations at once, two questions each over one shared licence
text (~`--doc-tokens` tokens), half of the clients on the root and half on the fine-tuned member, streamed
through the OpenAI chat API; once cold (all at once on a document no engine holds) and once on another
licence that was asked about on the root first, as in a chat backend where one member has read it. Two
ways, one after the other on the same machine:

- ``orchestra_vllm``: `orchestra serve --engine vllm`'s front over one vLLM engine per member with the family
  connector (a store of its own for this run): the document computed on one member reaches the other mapped;
- ``plain_vllm``: one vLLM engine per member with vLLM's own prefix caching only, called directly, as a user
  without orchestra runs them (no reuse across members).

Per way: answered, wall time, p50/p95 time to first token, completion tokens/s, and the prompt tokens the
engines computed (prompt tokens minus the cached ones vLLM reports). Writes benchmarks/results/<name>.json
and .md with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve_load import QUESTIONS, Answer, ask, summary, truncate  # noqa: E402  (its sibling: the same workload)
from vllm_family import vllm_engines  # noqa: E402


async def conversations(urls: dict[str, str], document: str, clients: int, models: list[str],
                        max_tokens: int, *, seen_on: str | None = None,
                        after_seen: Callable[[float], object] | None = None) -> dict[str, Any]:
    """`clients` conversations at once, two turns each, alternating between `models` (each at its own url);
    `seen_on`: one question on that member first (untimed), as when the document is already in use."""
    import httpx

    system = {"role": "system", "content": f"Answer questions about this licence.\n\n{document}"}
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    opened = {m: httpx.AsyncClient(base_url=urls[m], timeout=httpx.Timeout(3600.0), limits=limits) for m in models}
    if seen_on is not None:
        asked = time.time()
        await ask(opened[seen_on], seen_on, [system, {"role": "user", "content": "What is this licence?"}], 1)
        if after_seen is not None:
            await asyncio.to_thread(after_seen, asked)

    async def conversation(i: int) -> None:
        model = models[i % len(models)]
        messages = [system, {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (client {i})"}]
        first = await ask(opened[model], model, messages, max_tokens)
        answers.append(first)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Say more, briefly."}]
        answers.append(await ask(opened[model], model, messages, max_tokens))

    started = time.perf_counter()
    try:
        await asyncio.gather(*(conversation(i) for i in range(clients)))
    finally:
        for client in opened.values():
            await client.aclose()
    wall = time.perf_counter() - started
    out = summary(answers, wall)
    out["prompt_tokens"] = sum(a.prompt_tokens for a in answers)
    out["prompt_tokens_computed"] = sum(a.prompt_tokens - a.cached_tokens for a in answers)
    out["by_model"] = {m: {k: v for k, v in summary([a for a in answers if a.model == m], wall).items()
                           if k != "failed"} for m in models}
    return out


def way(home: Path, members: list[str], documents: dict[str, str], args: argparse.Namespace, tmp: Path, *,
        connector: bool) -> dict[str, Any]:
    """Both scenarios on one pair of engines, each over its own document (so neither finds the other's cached)."""
    with vllm_engines(home, members, args.max_model_len, tmp, connector=connector) as (engines, urls, started):
        # the root's save of the document has landed in the store (it writes behind the engine)
        seen = (lambda asked: engines.wait_stored(since=asked)) if connector else None
        result: dict[str, Any] = {
            scenario: asyncio.run(conversations(urls, text, args.clients, members, args.max_tokens,
                                                seen_on=members[0] if scenario == "seen" else None, after_seen=seen))
            for scenario, text in documents.items()}
        result["startup_s"] = round(started, 1)
        return result


_SCENARIOS = {"cold": "cold: every conversation starts at once on a document no engine holds",
              "seen": "seen: the document was asked about once on the root first (untimed), as in a chat backend "
                      "where one member has already read it"}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# The chat workload on vLLM: orchestra's connector vs plain vLLM ({report['clients']} conversations x 2 "
        f"turns, half on each member, ~{report['document_tokens']:,}-token documents, {report['max_tokens']} "
        "tokens a reply)", "",
        f"`{report['command']}` on {report['machine']}, one run, the two ways one after the other.", ""]
    for scenario, title in _SCENARIOS.items():
        lines += [f"## {title}", "",
                  "| way | answered | wall s | TTFT p50 s | TTFT p95 s | completion tok/s | prompt tokens computed |",
                  "|---|---|---|---|---|---|---|"]
        for name, runs in report["runs"].items():
            r = runs[scenario]
            lines.append(f"| {name} | {r['answered']}/{r['requests']} | {r['wall_s']:.1f} | {r['ttft_p50_s']:.2f} | "
                         f"{r['ttft_p95_s']:.2f} | {r['tokens_per_s']:.1f} | {r['prompt_tokens_computed']:,} "
                         f"of {r['prompt_tokens']:,} |")
        a, b = report["runs"]["orchestra_vllm"][scenario], report["runs"]["plain_vllm"][scenario]
        lines += ["", f"orchestra on vLLM computed {a['prompt_tokens_computed'] / max(1, b['prompt_tokens_computed']):.2f}x "
                  f"the prompt tokens plain vLLM did, in {a['wall_s'] / b['wall_s']:.2f}x its wall time, at "
                  f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x its completion tokens/s.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=None)
    parser.add_argument("--members", default="root,finetuned")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=1800)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default="vllm_chat_load")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from orchestra.family import load_family
    from orchestra.family.corpus import data_text

    family = load_family(args.home)
    home = Path(family.home)
    members = [family.member(m).name for m in args.members.split(",")]
    tok = AutoTokenizer.from_pretrained(family.member(members[0]).path)
    documents = {"cold": truncate(tok, data_text("apache-2.0.txt"), args.doc_tokens),
                 "seen": truncate(tok, data_text("mpl-2.0.txt"), args.doc_tokens)}
    document = documents["cold"]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"orchestra_vllm": way(home, members, documents, args, Path(tmp), connector=True),
                "plain_vllm": way(home, members, documents, args, Path(tmp), connector=False)}
    report = {"command": " ".join(["python", *sys.argv]), "machine": f"{platform.machine()}, {platform.processor()}, "
              f"{__import__('os').cpu_count()} cores", "clients": args.clients, "max_tokens": args.max_tokens,
              "document_tokens": len(tok(document, add_special_tokens=False)["input_ids"]), "members": members,
              "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(report, indent=2)), (".md", markdown(report))):
        target = args.out / f"{args.name}{suffix}"
        partial = target.with_suffix(suffix + ".tmp")
        partial.write_text(text)
        partial.replace(target)
    print(markdown(report))


if __name__ == "__main__":
    main()
