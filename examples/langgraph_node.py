"""A LangGraph graph whose nodes run on different members of one family, over one prefill of the document.

    orchestra serve --port 8000 &
    python examples/langgraph_node.py [--base-url http://127.0.0.1:8000/v1] [--document FILE]
        [--writer root] [--reviewer finetuned] [--max-tokens 64] [--trace FILE]

Three nodes, each a `ChatOpenAI` (langchain-openai) pointed at `orchestra serve` with the model set to a
family member; every one of them sends the document as its first (system) message:

    summarize (writer) -> review (reviewer) -> revise (writer)

The server keeps one prefix cache for the whole family, so the document is prefilled once, by
``summarize``. ``review`` runs on another member: the writer's cache of the document is *mapped* into it
(checked by the gates; re-prefilled only when a gate says no), and ``revise`` is back on the writer, whose
own cache of the document is reused exactly. Each node records what the server said about its prompt:
the ``x-orchestra-cache`` header (exact, mapped, reprefilled), the member the cache was mapped from, and
``usage.prompt_tokens_details.cached_tokens`` (prompt tokens not recomputed). On a family built with
`orchestra family build` the maps are calibrated; elsewhere start the server with
``--on-missing-mapping calibrate`` (else a member without a map prefills the document itself).
A missing document or a server that cannot be reached is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import sys
from pathlib import Path
from typing import Annotated, Any, TypedDict

INSTRUCTION = "Answer questions about this document, briefly."


class NodeTrace(TypedDict):
    """What one node's request cost, as the server reported it."""

    node: str
    model: str
    cache: str
    """exact | mapped | reprefilled (the x-orchestra-cache header)"""
    source: str | None
    """The member whose cache was mapped (x-orchestra-cache-source)."""
    cached_tokens: int
    prompt_tokens: int


class Review(TypedDict, total=False):
    """The graph's state: the document, what each node wrote, and one trace entry per node (appended)."""

    document: str
    summary: str
    review: str
    revised: str
    trace: Annotated[list[NodeTrace], operator.add]


def build_graph(base_url: str, *, writer: str = "root", reviewer: str = "finetuned", max_tokens: int = 64,
                api_key: str = "unused") -> Any:
    """The compiled graph: summarize on `writer`, review on `reviewer`, revise on `writer`."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    def ask(node: str, model: str, document: str, question: str) -> tuple[str, NodeTrace]:
        chat = ChatOpenAI(base_url=base_url, api_key=api_key, model=model,  # type: ignore[call-arg]  # field aliases
                          max_tokens=max_tokens, temperature=0, max_retries=0, include_response_headers=True)
        # the same first message in every node: the cached prefix every member shares
        reply = chat.invoke([SystemMessage(f"{INSTRUCTION}\n\n{document}"), HumanMessage(question)])
        headers = reply.response_metadata.get("headers", {})
        usage = reply.response_metadata.get("token_usage", {})
        details = usage.get("prompt_tokens_details") or {}
        trace = NodeTrace(node=node, model=model, cache=headers.get("x-orchestra-cache", "?"),
                          source=headers.get("x-orchestra-cache-source"),
                          cached_tokens=int(details.get("cached_tokens") or 0),
                          prompt_tokens=int(usage.get("prompt_tokens") or 0))
        return str(reply.content), trace

    def summarize(state: Review) -> Review:
        text, trace = ask("summarize", writer, state["document"], "Summarise the document in two sentences.")
        return {"summary": text, "trace": [trace]}

    def review(state: Review) -> Review:
        text, trace = ask("review", reviewer, state["document"],
                          f"A summary of the document:\n{state['summary']}\nWhat does it get wrong or leave out?")
        return {"review": text, "trace": [trace]}

    def revise(state: Review) -> Review:
        text, trace = ask("revise", writer, state["document"],
                          f"A summary of the document:\n{state['summary']}\nA review of it:\n{state['review']}\n"
                          "Write a better summary in two sentences.")
        return {"revised": text, "trace": [trace]}

    graph = StateGraph(Review)
    graph.add_node("summarize", summarize)
    graph.add_node("review", review)
    graph.add_node("revise", revise)
    graph.add_edge(START, "summarize")
    graph.add_edge("summarize", "review")
    graph.add_edge("review", "revise")
    graph.add_edge("revise", END)
    return graph.compile()


def default_document() -> str:
    from orchestra.family.corpus import data_text  # a bundled licence text, ~2k tokens

    return data_text("apache-2.0.txt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--document", type=Path, help="a text file (default: the Apache-2.0 licence)")
    parser.add_argument("--writer", default="root", help="the member that summarizes and revises")
    parser.add_argument("--reviewer", default="finetuned", help="the member that reviews")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trace", type=Path, help="also write the final state (texts and per-node trace) as JSON")
    args = parser.parse_args(argv)
    if args.document is not None and not args.document.is_file():
        print(f"error: --document {args.document} is not a file", file=sys.stderr)
        return 2
    document = args.document.read_text(encoding="utf-8") if args.document else default_document()

    import openai

    graph = build_graph(args.base_url, writer=args.writer, reviewer=args.reviewer, max_tokens=args.max_tokens,
                        api_key=os.environ.get("OPENAI_API_KEY", "unused"))  # the key of --api-key-env, if set
    try:
        state: Review = graph.invoke({"document": document})
    except openai.APIConnectionError:
        print(f"error: no server answers at {args.base_url}: start one with `orchestra serve`", file=sys.stderr)
        return 2
    except openai.APIStatusError as exc:  # an unknown model, a prompt over the context, a wrong key
        print(f"error: the server answered {exc.status_code}: {exc.message}", file=sys.stderr)
        return 2

    written = {"summarize": state.get("summary", ""), "review": state.get("review", ""),
               "revise": state.get("revised", "")}
    for step in state["trace"]:
        mapped = f" from {step['source']}" if step["source"] else ""
        print(f"== {step['node']} on {step['model']}: cache {step['cache']}{mapped}, "
              f"{step['cached_tokens']} of {step['prompt_tokens']} prompt tokens not recomputed")
        print(written[step["node"]].strip())
    if args.trace is not None:
        args.trace.write_text(json.dumps({k: v for k, v in state.items() if k != "document"}, indent=2),
                              encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
