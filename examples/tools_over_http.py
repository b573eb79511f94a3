"""A tool round trip with the official `openai` client against `orchestra serve`: a call, its result, the answer.

    orchestra serve --port 8000 &
    python examples/tools_over_http.py [--base-url http://127.0.0.1:8000/v1] [--model root] [--document FILE]
        [--question TEXT] [--max-tokens 128] [--transcript FILE]

The document goes in the system message, and the request offers one function, ``find_passages(word)``,
which this script runs itself (the passages of the document that contain the word):

1. the first request asks with ``tool_choice="required"``: the server decodes the reply under a grammar of
   a call of an offered function, so it comes back as ``message.tool_calls`` with JSON arguments
   (``finish_reason: "tool_calls"``);
2. the script runs the call and sends its result back as a ``role: "tool"`` message (after the assistant
   message that made the call);
3. the second request (``tool_choice="none"``) gets the final answer, written with the result in view.

Both requests start with the same system message, so the second one does not prefill the document again:
``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens came from the cache. With
`--transcript` the requests and replies are also written as JSON. A missing document, or a server that
cannot be reached or refuses the request, is one ``error:`` line and exit code 2; a reply that makes no call
(cut off by --max-tokens) is exit code 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import openai
from openai import OpenAI
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam, ChatCompletionToolParam

FIND_PASSAGES: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "find_passages",
    "description": "Find the passages of the document that contain a word.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 24}},
                   "required": ["word"], "additionalProperties": False}}}
QUESTION = "Which passages talk about warranty? Look them up, then answer."


def find_passages(document: str, word: str, limit: int = 3) -> str:
    """The tool itself: up to `limit` paragraphs of `document` containing `word` (case-insensitive)."""
    paragraphs = [p.strip() for p in document.split("\n\n") if word.strip() and word.strip().lower() in p.lower()]
    return "\n\n".join(p[:400] for p in paragraphs[:limit]) or f"no passage contains {word!r}"


def default_document() -> str:
    from orchestra.family.corpus import data_text  # a bundled licence text, ~2k tokens

    return data_text("apache-2.0.txt")


def _cached(completion: ChatCompletion) -> str:
    usage = completion.usage
    if usage is None:
        return "no usage"
    details = usage.prompt_tokens_details
    return f"{details.cached_tokens if details else 0} of {usage.prompt_tokens} prompt tokens from the cache"


def round_trip(client: OpenAI, model: str, document: str, question: str, max_tokens: int) -> dict[str, Any]:
    """The two requests and the tool call between them; what was sent and received, as JSON-ready data."""
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": f"Answer questions about this document.\n\n{document}"},
        {"role": "user", "content": question}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[FIND_PASSAGES],
                                           tool_choice="required", max_tokens=max_tokens, temperature=0)
    record: dict[str, Any] = {"model": model, "first": {"messages": list(messages), "reply": first.model_dump()}}
    choice = first.choices[0]
    if not choice.message.tool_calls:
        record["error"] = (f"the model made no call (finish_reason {choice.finish_reason!r}): raise --max-tokens "
                           f"(now {max_tokens})")
        return record
    call = choice.message.tool_calls[0]
    if call.type != "function":
        record["error"] = f"the model made a {call.type!r} call, not a function call"
        return record
    arguments = json.loads(call.function.arguments)  # JSON the server's grammar guarantees
    result = find_passages(document, str(arguments.get("word", "")))
    print(f"call: {call.function.name}({json.dumps(arguments)}) [{_cached(first)}]")
    print(f"result: {result[:200]}{'...' if len(result) > 200 else ''}")
    record["tool"] = {"id": call.id, "name": call.function.name, "arguments": arguments, "result": result}

    messages += [  # the assistant turn that made the call, then the call's result
        {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[FIND_PASSAGES],
                                           tool_choice="none", max_tokens=max_tokens, temperature=0)
    answer = final.choices[0].message.content or ""
    print(f"answer: {answer.strip()} [{_cached(final)}]")
    record["final"] = {"messages": messages, "reply": final.model_dump()}
    record["answer"] = answer
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="root", help="a family member, by role or name")
    parser.add_argument("--document", type=Path, help="a text file (default: the Apache-2.0 licence)")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--transcript", type=Path, help="also write the requests and replies here as JSON")
    args = parser.parse_args(argv)
    if args.document is not None and not args.document.is_file():
        print(f"error: --document {args.document} is not a file", file=sys.stderr)
        return 2
    document = args.document.read_text(encoding="utf-8") if args.document else default_document()

    # with `orchestra serve --api-key-env NAME`, export the same key as OPENAI_API_KEY
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0)
    try:
        record = round_trip(client, args.model, document, args.question, args.max_tokens)
    except openai.APIConnectionError:
        print(f"error: no server answers at {args.base_url}: start one with `orchestra serve`", file=sys.stderr)
        return 2
    except openai.APIStatusError as exc:  # an unknown model, a prompt over the context, a wrong key
        print(f"error: the server answered {exc.status_code}: {exc.message}", file=sys.stderr)
        return 2
    if args.transcript is not None:
        args.transcript.write_text(json.dumps(record, indent=2), encoding="utf-8")
    if "error" in record:
        print(f"error: {record['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
