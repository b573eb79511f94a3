"""examples/langgraph_node.py against a live `orchestra serve` on a tiny family home: a three-node LangGraph graph
over two members, the document prefilled once by the first node and reused (mapped, then exact) by the others."""

from __future__ import annotations

import json

from examples import langgraph_node


def test_every_node_runs_and_the_reviewer_gets_the_document_mapped_from_the_writers_cache(
        tiny_server, short_document_file, tmp_path, capsys):
    trace_file = tmp_path / "trace.json"
    code = langgraph_node.main(["--base-url", f"{tiny_server.base_url}/v1", "--document", str(short_document_file),
                                "--writer", "root", "--reviewer", "finetuned", "--max-tokens", "12",
                                "--trace", str(trace_file)])
    out = capsys.readouterr().out
    assert code == 0, out
    state = json.loads(trace_file.read_text())

    trace = state["trace"]
    assert [(t["node"], t["model"]) for t in trace] == [("summarize", "root"), ("review", "finetuned"),
                                                        ("revise", "root")]
    assert all(state[key].strip() for key in ("summary", "review", "revised"))  # every node wrote something
    summarize, review, revise = trace
    # the first node prefilled the document (another test's prompt on this server may share a few leading tokens) ...
    assert summarize["cache"] == "exact" and summarize["cached_tokens"] < summarize["prompt_tokens"] // 2
    # ... the second, on another member, got it mapped from the first one's cache: not recomputed ...
    assert review["cache"] == "mapped" and review["source"] == "root", review
    assert review["cached_tokens"] > review["prompt_tokens"] // 2
    # ... and the third, back on the writer, reused the writer's own cache of it
    assert revise["cache"] == "exact" and revise["cached_tokens"] > revise["prompt_tokens"] // 2
    assert "== review on finetuned: cache mapped from root" in out


def test_a_missing_document_is_one_line_and_exit_2(tmp_path, capsys):
    assert langgraph_node.main(["--document", str(tmp_path / "absent.txt")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: --document {tmp_path / 'absent.txt'} is not a file"]
