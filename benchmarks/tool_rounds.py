"""Tokens computed per tool round: a tool-using conversation over a ~4k-token document against `orchestra serve`.

    python benchmarks/tool_rounds.py [--rounds 3] [--tokens 4000] [--model root] [--then finetuned]

A live server (the bundled family, CPU) and the official `openai` client: the document is in the system
message, the user asks a question, and each round the model must call `lookup` (tool_choice required) and
gets a result back; the last round answers. Per round the server reports prompt tokens and cached tokens
(`usage.prompt_tokens_details.cached_tokens`): what the round computed is their difference. The baseline is
a server without a prefix cache, which computes every prompt token of every round (the client re-sends the
whole conversation each time, as OpenAI clients do). `--then` runs the answer round on another member (its
document comes mapped, not prefilled). Writes results/tool_rounds.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Find the passages of the licence that mention a word.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}


def _serve(home: str | None, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    from orchestra.serve import ServerStartError, start_server

    args = ["--device", "cpu", "--max-tokens-limit", "256", "--cache-mb", "2048"] + (["--home", home] if home else [])
    try:
        server = start_server(args, log=log, env={"ORCHESTRA_KV_STORE": "off"}, cwd=ROOT, timeout=180)
    except ServerStartError as exc:
        raise SystemExit(str(exc)) from None
    return server.process, server.base_url


def conversation(client: Any, document: str, rounds: int, model: str, then: str | None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"Answer questions about this licence.\n\n{document}"},
        {"role": "user", "content": "What does the licence say about warranty and liability? Look it up."}]
    rows = []
    for index in range(rounds + 1):
        last = index == rounds
        member = then if last and then else model
        t0 = time.perf_counter()
        reply = client.chat.completions.create(model=member, messages=messages, tools=[LOOKUP], max_tokens=64,
                                               tool_choice="none" if last else "required", temperature=0)
        seconds = time.perf_counter() - t0
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        message = reply.choices[0].message
        rows.append({"round": index + 1, "model": member, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
                     "computed_tokens": usage.prompt_tokens - cached, "completion_tokens": usage.completion_tokens,
                     "seconds": seconds, "finish_reason": reply.choices[0].finish_reason,
                     "call": message.tool_calls[0].function.model_dump() if message.tool_calls else None})
        if last:
            break
        call = message.tool_calls[0]
        word = json.loads(call.function.arguments).get("word", "")
        found = "\n".join(line for line in document.splitlines() if word and word.lower() in line.lower())[:300]
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": found or "no passage mentions it"}]
    return rows


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        "# Tokens computed per tool round", "",
        f"Command: `{result['command']}`. Machine: {result['machine']}. A {result['document_tokens']}-token document "
        "in the system message; each round the model calls `lookup` (tool_choice required) and the result is "
        "sent back; the last round answers. *computed* = prompt tokens - cached tokens, as the server reports "
        "them; a server without a prefix cache computes every prompt token of every round.", "",
        "| round | member | prompt tokens | cached | computed here | computed without a prefix cache | seconds | "
        "finish |", "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['round']} | {r['model']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                     f"{r['computed_tokens']} | {r['prompt_tokens']} | {r['seconds']:.2f} | {r['finish_reason']} |")
    here = sum(r["computed_tokens"] for r in rows)
    without = sum(r["prompt_tokens"] for r in rows)
    later = rows[1:]
    lines += ["", f"Over the conversation: {here} prompt tokens computed against {without} without a prefix cache "
              f"({without / max(1, here):.1f}x fewer); after the first round {sum(r['computed_tokens'] for r in later)} "
              f"against {sum(r['prompt_tokens'] for r in later)}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    from _results import command_line, write_results

    from orchestra.bench import machine_info
    from orchestra.documents.texts import data_text

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--model", default="root")
    parser.add_argument("--then", default="finetuned", help="the member that answers (empty: --model)")
    parser.add_argument("--home", default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = parser.parse_args()

    from openai import OpenAI
    from transformers import AutoTokenizer

    from orchestra.family import load_family

    family = load_family(args.home)
    tokenizer = AutoTokenizer.from_pretrained(family.member_path("root"))
    ids = tokenizer(data_text("gpl-3.txt"), add_special_tokens=False)["input_ids"][: args.tokens]
    document = tokenizer.decode(ids)
    log = Path(tempfile.mkdtemp(prefix="tool_rounds_")) / "server.log"
    process, url = _serve(args.home, log)
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        rows = conversation(client, document, args.rounds, args.model, args.then or None)
    finally:
        process.terminate()
        process.wait(60)
    machine = machine_info()
    result = {"command": command_line("tool_rounds.py", None),
              "machine": f"{machine.cpu_model}, {machine.cpu_count} CPUs, torch {machine.torch}",
              "document_tokens": len(ids), "rows": rows}
    write_results(args.out, "tool_rounds", result, markdown(result))


if __name__ == "__main__":
    main()
