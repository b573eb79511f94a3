"""Chunked documents: split_document's properties, and map-reduce runs whose chunks are each prefilled once."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from orchestra.documents.chunking import Chunk, prefix_tokens, select_chunks, split_document
from orchestra.errors import DocumentError
from orchestra.family.corpus import data_text
from orchestra.observability.events import CacheReady, CacheStepEvent, DocumentPrefilled, TokenEvent
from orchestra.pipelines.spec import PipelineSpec
from orchestra.runs._mapreduce import merge_json
from orchestra.runs.scheduler import Orchestra
from tests.orchestra.familycache.test_core import TokenCounter
from tests.tiny_family import make_tokenizer

WINDOW = 260


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _document() -> str:
    gpl = data_text("gpl-3.txt")
    return (f"[page 1]\n{gpl[:420]}\n\n[page 2]\n\n[page 3]\n## Terms\n{gpl[420:700]}\n\n"
            "Name | Role | Term\nAda | chair | 3 years\nBob | treasurer | 2 years\nCy | member | 1 year\n\n"
            f"[page 4]\n{gpl[700:1000]}\n")


def _check(text: str, chunks: list[Chunk], tok, window: int) -> None:
    covered = [False] * len(text)
    for i, chunk in enumerate(chunks):
        assert chunk.index == i and chunk.text == text[chunk.start:chunk.end] and chunk.text.strip()
        assert chunk.tokens == len(prefix_tokens(chunk.text, tok)) <= window  # the real DocumentPrompt prefix
        covered[chunk.start:chunk.end] = [True] * (chunk.end - chunk.start)
    assert all(covered)


def test_chunks_cover_the_document_fit_the_window_and_overlap(tok):
    text = _document()
    chunks = split_document(text, tok, WINDOW, overlap_tokens=24)
    assert len(chunks) >= 4
    _check(text, chunks, tok, WINDOW)
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert before.start < after.start < before.end  # the overlap: the previous chunk's trailing text
        assert before.end <= after.end
    assert split_document(text, tok, WINDOW, overlap_tokens=24) == chunks  # deterministic
    assert chunks[0].anchor == "[page 1]" and chunks[-1].anchor == "[page 4]"
    assert chunks[1].label(len(chunks)).startswith(f"[chunk 2/{len(chunks)}, page ")


def test_a_table_and_a_sentence_are_cut_at_their_rows_and_words(tok):
    rows = "\n".join(f"row {i} | value {i * 7} | note {i}" for i in range(40))
    chunks = split_document(rows, tok, 200, overlap_tokens=0)
    assert len(chunks) > 1
    _check(rows, chunks, tok, 200)
    assert all(c.text.endswith("\n") or c.end == len(rows) for c in chunks)  # whole rows, never half a row
    sentence = "word " * 300  # one sentence, no structure: cut between words
    chunks = split_document(sentence, tok, 200, overlap_tokens=8)
    _check(sentence, chunks, tok, 200)
    assert all(c.text.endswith(" ") or c.end == len(sentence) for c in chunks)


def test_a_document_that_fits_is_one_chunk_exactly_its_text(tok):
    text = data_text("gpl-3.txt")[:200]
    size = len(prefix_tokens(text, tok))
    (only,) = split_document(text, tok, size)  # exactly one window
    assert only.text == text and (only.start, only.end, only.tokens) == (0, len(text), size)
    assert len(split_document(text, tok, size - 1, overlap_tokens=0)) == 2


def test_an_empty_page_anchor_gets_no_chunk_of_its_own(tok):
    text = "[page 1]\n" + "alpha beta gamma. " * 30 + "\n\n[page 2]\n\n[page 3]\n" + "delta epsilon. " * 30
    chunks = split_document(text, tok, 200, overlap_tokens=0)
    _check(text, chunks, tok, 200)
    assert not any(c.text.strip() == "[page 2]" for c in chunks)


def test_a_window_without_room_for_text_is_refused(tok):
    with pytest.raises(DocumentError, match="raise chunking.window_tokens"):
        split_document(data_text("gpl-3.txt")[:2000], tok, 135)


def test_bm25_picks_the_relevant_chunks_in_document_order():
    texts = ["cats purr and sleep", "the dividend was approved by the board", "dogs bark", "board meeting dividend"]
    assert select_chunks(texts, "What dividend did the board approve?", 2) == [1, 3]
    assert select_chunks(texts, "anything", 9) == [0, 1, 2, 3]


def test_json_outputs_merge_into_one_value():
    merged, dropped = merge_json([("[chunk 1/2]", {"facts": ["a", "b"]}), ("[chunk 2/2]", {"facts": ["b", "c"]})])
    assert merged == {"facts": ["a", "b", "c"]} and dropped == 1
    items, _ = merge_json([("[chunk 1/2]", [{"x": 1}]), ("[chunk 2/2]", [{"x": 2}])])
    assert items == [{"x": 1, "chunk": "[chunk 1/2]"}, {"x": 2, "chunk": "[chunk 2/2]"}]


def test_a_json_agents_chunks_show_only_items_no_earlier_chunk_showed():
    """Overlapping chunks give the same sentence twice; the output shows it once, and what reads it gets lines."""
    from orchestra.runs._mapreduce import Part, combine, readable

    def result(value):
        return SimpleNamespace(degenerate=None, parsed=value, output_text=lambda: json.dumps(value),
                               downstream_text=lambda: json.dumps(value))

    parts = [Part(SimpleNamespace(index=i), f"[chunk {i + 1}/2]", [], "root") for i in range(2)]
    combined = combine(True, [(parts[0], result({"facts": ["Copies may be sold.", "No warranty."]})),
                              (parts[1], result({"facts": ["copies may be sold", "Changes are marked."]}))])
    assert combined.text.count("Copies may be sold") == 1 and "copies may be sold" not in combined.text
    assert json.loads(combined.text.split("[chunk 2/2]\n", 1)[1]) == {"facts": ["Changes are marked."]}
    assert readable(combined.parsed) == "facts:\n- Copies may be sold.\n- No warranty.\n- Changes are marked."
    assert combined.duplicates_removed == 1


# -- chunked runs on the tiny family -----------------------------------------------------------------------------

def _agent(name, model, task="Summarise the document.", upstream=(), max_new_tokens=8, **node):
    return {"name": name, "model": model, "upstream": list(upstream), **node,
            "spec": {"role": "You are careful.", "task": task,
                     "generation": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}}


def _pipeline(fam, agents, **chunking) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "name": "chunked", "models": {"base": str(fam.parent), "child": str(fam.child)}, "source": "base",
        "default_device": "cpu", "agents": agents, "kv_store": {"enabled": False},
        "gate": {"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0, "max_excess_kl": 100.0}},
        "chunking": {"window_tokens": WINDOW, "overlap_tokens": 24, **chunking},
    })


async def test_each_chunk_is_prefilled_once_and_shared_by_map_and_reduce_agents(fam, mapstore):
    pipe = _pipeline(fam, [
        _agent("notes", "base"), _agent("points", "child"), _agent("third", "base", chunks=2),
        _agent("final", "base", task="Combine {notes} and {points}."),
    ])
    orch = Orchestra(pipe, mappings=mapstore)
    mapstore.get(orch.registry.load("base"), orch.registry.load("child"))  # calibrated before counting
    counter = TokenCounter(orch.registry.load("base").model)
    events: list[object] = []
    try:
        report = await orch.run(_document(), on_event=events.append)
    finally:
        counter.remove()
    assert report.succeeded == ["notes", "points", "third", "final"], [a.error for a in report.agents]
    n = len(report.chunks)
    assert n >= 4 and [c.index for c in report.chunks] == list(range(n))
    # each chunk is prefilled on the source once (after the first, its shared preamble is reused), never again
    prefills = [e.step for e in events if isinstance(e, CacheStepEvent) and e.step.step == "prefill"
                and e.step.member == "base" and e.chunk is not None]
    assert sorted(e.chunk for e in events if isinstance(e, CacheStepEvent) and e.step.step == "prefill"
                  and e.step.member == "base" and e.chunk is not None) == list(range(n))
    assert [s.tokens + s.reused_tokens for s in prefills] == [c.tokens for c in report.chunks]
    ran = Counter(counter.tokens)
    assert all(ran[s.tokens] >= 1 for s in prefills)  # the base model's forward passes computed exactly these
    assert sum(ran[t] for t in {s.tokens for s in prefills}) == len(prefills)
    assert all(c.paths == {"base": "exact", "child": "mapped"} for c in report.chunks)
    notes, points = report.agent("notes"), report.agent("points")
    assert [c.index for c in notes.chunks] == list(range(n)) and {c.cache_path for c in points.chunks} == {"mapped"}
    assert len(report.agent("third").chunks) == 2
    assert notes.output.startswith(f"[chunk 1/{n}, page 1]\n") and f"[chunk {n}/{n}, page 4]" in notes.output
    final = report.agent("final")
    assert final.chunks[-1].round >= 1 and {c.cache_path for c in final.chunks} == {"exact"}  # its own notes
    assert report.prefill_s_every_chunk > 0  # what re-prefilling every chunk call would have cost (an estimate)
    prefilled = [e for e in events if isinstance(e, DocumentPrefilled)]
    assert sorted(e.chunk for e in prefilled if e.chunk is not None) == list(range(n))
    assert {e.chunk for e in events if isinstance(e, CacheReady) and e.model == "child"} == set(range(n))


async def test_a_reduce_over_notes_longer_than_a_window_runs_in_rounds(fam, mapstore):
    pipe = _pipeline(fam, [_agent("notes", "base", max_new_tokens=24),
                           _agent("final", "base", task="Combine {notes}.", max_new_tokens=8)])
    report = await Orchestra(pipe, mappings=mapstore).run(_document())
    final = report.agent("final")
    assert final.status == "succeeded", final.error or final.degenerate_reason
    rounds = [c.round for c in final.chunks]
    assert rounds[0] == 1 and rounds[-1] >= 2 and rounds.count(rounds[-1]) == 1  # several calls, then one


async def test_mode_never_refuses_the_long_document_with_its_fix(fam, mapstore):
    orch = Orchestra(_pipeline(fam, [_agent("a", "base")], mode="never"), mappings=mapstore)
    with pytest.raises(DocumentError, match="takes at most 512.*shorten the document"):
        await orch.run(data_text("gpl-3.txt")[:3000])


@pytest.mark.parametrize("parallel", [None, 4], ids=["in-turn", "parallel"])
async def test_a_chunk_call_failure_names_the_chunk_and_spares_other_agents(fam, mapstore, parallel):
    extra = {"parallel_calls": parallel} if parallel else {}
    pipe = _pipeline(fam, [_agent("ok", "base"), _agent("bad", "base")], **extra)
    orch = Orchestra(pipe, mappings=mapstore)
    generate = orch.cache.executor.generate
    calls = {"bad": 0}

    async def flaky(member, spec, **kwargs):
        if spec.name == "bad":
            calls["bad"] += 1
            if calls["bad"] == 2:
                raise RuntimeError("boom")
        return await generate(member, spec, **kwargs)

    orch.cache.executor.generate = flaky  # type: ignore[method-assign]
    report = await orch.run(_document())
    assert report.agent("ok").status == "succeeded"
    bad = report.agent("bad")
    assert bad.status == "failed" and bad.error_type == "ChunkCallError" and "RuntimeError: boom" in bad.error
    assert bad.error.startswith("agent 'bad' failed on [chunk ")
    if parallel is None:  # in turn, the second call is the second chunk's
        assert "[chunk 2/" in bad.error


async def _in_flight_per_agent(orch) -> dict[str, int]:
    """Wraps the executor's generate to record the most calls of each agent in flight at once."""
    generate = orch.cache.executor.generate
    now: Counter[str] = Counter()
    most: dict[str, int] = {}

    async def counted(member, spec, **kwargs):
        now[spec.name] += 1
        most[spec.name] = max(most.get(spec.name, 0), now[spec.name])
        try:
            return await generate(member, spec, **kwargs)
        finally:
            now[spec.name] -= 1

    orch.cache.executor.generate = counted  # type: ignore[method-assign]
    return most


async def test_parallel_chunk_calls_overlap_and_report_in_document_order(fam, mapstore):
    pipe = _pipeline(fam, [_agent("notes", "base", max_new_tokens=6)], parallel_calls=3)
    orch = Orchestra(pipe, mappings=mapstore)
    most = await _in_flight_per_agent(orch)
    events: list[object] = []
    report = await orch.run(_document(), on_event=events.append)
    notes = report.agent("notes")
    assert notes.status == "succeeded", notes.error
    n = len(report.chunks)
    assert n >= 4 and most["notes"] == 3
    assert [c.index for c in notes.chunks] == list(range(n))
    labels = [line for line in notes.output.splitlines() if line.startswith("[chunk ")]
    assert [label.split("/")[0] for label in labels] == [f"[chunk {i + 1}" for i in range(n)]
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.agent == "notes"]
    assert {e.chunk for e in tokens} == set(range(n))  # calls in flight at once: each token says its chunk


async def test_chunk_calls_default_to_what_the_executor_can_run_at_once(fam, mapstore):
    orch = Orchestra(_pipeline(fam, [_agent("notes", "base", max_new_tokens=4)]), mappings=mapstore)
    assert orch.cache.executor.parallelism("base") == 1
    most = await _in_flight_per_agent(orch)
    orch.cache.executor.parallelism = lambda member: 2  # type: ignore[method-assign]
    report = await orch.run(_document())
    assert report.agent("notes").status == "succeeded" and most["notes"] == 2


async def test_a_pdf_of_many_windows_is_read_per_page_and_each_chunk_prefilled_once(fam, mapstore, tmp_path):
    from orchestra.documents.formats import load_document
    from tests.orchestra.documents.test_documents import _pdf

    text = data_text("gpl-3.txt")
    pdf = tmp_path / "long.pdf"
    pdf.write_bytes(_pdf([text[i * 700:(i + 1) * 700] for i in range(6)]))
    document = load_document(pdf)
    orch = Orchestra(_pipeline(fam, [_agent("notes", "child")]), mappings=mapstore)
    events: list[object] = []
    report = await orch.run(document.text, on_event=events.append)
    assert report.agent("notes").status == "succeeded"
    n = len(report.chunks)
    assert n >= 6 and len(document.text) > 0
    assert all(c.anchor is not None and c.anchor.startswith("[page ") for c in report.chunks)
    assert {c.anchor for c in report.chunks} == {f"[page {i}]" for i in range(1, 7)}
    prefills = Counter(e.chunk for e in events if isinstance(e, CacheStepEvent) and e.step.step == "prefill"
                       and e.step.member == "base" and e.chunk is not None)
    assert prefills == Counter(range(n))  # every chunk once on the source, mapped into the agent's member
    assert {c.paths["child"] for c in report.chunks} == {"mapped"}


def test_chunking_is_declared_in_yaml_and_in_the_builder(fam, tmp_path):
    from orchestra import Pipeline
    from orchestra.pipelines.spec import load_pipeline

    path = tmp_path / "p.yaml"
    path.write_text(f"""
models: {{base: {fam.parent}}}
chunking: {{mode: always, window_tokens: 300, overlap_tokens: 16}}
agents:
  - {{name: facts, model: base, builtin: key_facts, chunks: 3}}
  - {{name: summary, model: base, builtin: summarizer, per_chunk: true}}
""")
    spec = load_pipeline(path)
    assert (spec.chunking.mode, spec.chunking.window_tokens, spec.chunking.overlap_tokens) == ("always", 300, 16)
    assert spec.agent("facts").chunks == 3 and spec.agent("summary").per_chunk is True
    built = Pipeline("p", chunking={"mode": "never"}).agent("summarizer", per_chunk=False, chunks="all").spec
    assert built.chunking.mode == "never" and built.agents[0].per_chunk is False


def test_choosing_k_chunks_without_rank_bm25_names_the_install(monkeypatch):
    import sys

    from agents.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "rank_bm25", None)
    with pytest.raises(MissingDependencyError, match=r"pip install rank-bm25"):
        select_chunks(["a", "b", "c"], "a", 1)


async def test_a_window_too_wide_for_the_agents_prompts_is_refused_before_any_prefill(fam, mapstore):
    orch = Orchestra(_pipeline(fam, [_agent("a", "base", max_new_tokens=200)], window_tokens=400), mappings=mapstore)
    with pytest.raises(DocumentError, match="chunking.window_tokens is 400.*lower it to"):
        await orch.run(_document())


def test_k_chunks_are_ranked_against_the_question_not_the_built_ins_instructions():
    """An agent's instructions may say "the document above": over a licence for *documentation*, ranking by the
    whole task would pick its chunks over the one that answers; the question alone (or `query`) picks right."""
    from orchestra.pipelines.spec import AgentNode
    from orchestra.runs._chunked import _retrieval_query

    texts = ["The Document is a manual. The Document may be copied. A Document is published by its publisher; to use "
             "this License in a document, put the document above the notice.",
             "The Apache License, Version 2.0, January 2004, was published by the Apache Software Foundation.",
             "Document means the manual. Copies of the Document, in three or more sentences, may be published in "
             "quantity if the document says so."]
    node = AgentNode.model_validate({"builtin": "question_answerer", "model": "m",
                                     "args": {"question": "When was the Apache License published?"}})
    spec = node.agent_spec()
    worded = ("Question: When was the Apache License published?\n\nAnswer this question from the document above in "
              "one to three sentences. If the document does not answer it, say so.")
    assert select_chunks(texts, worded, 1) == [2]  # the instructions' "document" words win: the wrong chunk
    assert _retrieval_query(node, spec, {}) == "When was the Apache License published?"
    assert select_chunks(texts, _retrieval_query(node, spec, {}), 1) == [1]
    custom = AgentNode.model_validate({"name": "a", "model": "m", "query": "{topic} release",
                                       "spec": {"task": "Answer about {topic} from the document above."}})
    assert _retrieval_query(custom, custom.agent_spec(), {"topic": "Apache"}) == "Apache release"
    plain = AgentNode.model_validate({"name": "b", "model": "m", "spec": {"task": "Summarise {topic}."}})
    assert _retrieval_query(plain, plain.agent_spec(), {"topic": "Apache"}) == "Summarise Apache."
