"""Sessions: one document held on its members for many questions; named sessions reopen later."""

from __future__ import annotations

import anyio
import pytest

from orchestra import Pipeline, SessionError
from orchestra.errors import DocumentError
from orchestra.family.corpus import data_text
from tests.orchestra.familycache.test_core import TokenCounter

DOC = data_text("gpl-3.txt")[:300]
QUESTIONS = ["Who?", "What may I copy?", "Is there a warranty?", "Can I sell it?", "Which version?",
             "Who holds the copyright?", "May I modify it?", "What about patents?", "Is it free?", "What is GPL?"]


def _pipeline(fam, mapstore, tmp_path) -> Pipeline:
    return (Pipeline("qa", source="base", models={"base": str(fam.parent), "child": str(fam.child)},
                     mapping={"directory": str(mapstore.directory), "on_missing": "calibrate"}, default_device="cpu",
                     home=str(tmp_path / "home"), kv_store={"directory": str(tmp_path / "kv")})
            .with_input("question")
            .agent({"name": "draft", "task": "Answer briefly: {question}", "generation": {"max_new_tokens": 3}},
                   model="child")
            .agent({"name": "answer", "task": "Improve: {draft}", "generation": {"max_new_tokens": 3}}, model="base"))


def test_a_session_answers_ten_questions_computing_only_the_questions(fam, mapstore, tmp_path):
    pipeline = _pipeline(fam, mapstore, tmp_path)
    models = [pipeline.orchestra().cache.executor.model(m).model for m in ("base", "child")]
    doc_tokens = None
    with pipeline.session(DOC) as s:
        counters = [TokenCounter(model) for model in models]
        try:
            answers = [s.ask(q) for q in QUESTIONS]
        finally:
            for counter in counters:
                counter.remove()
        doc_tokens = s.reports[0].document_tokens
    assert len(answers) == 10 and all(isinstance(a, str) for a in answers)
    assert [r.inputs["question"] for r in s.reports] == QUESTIONS
    for report in s.reports:  # every cache was the held one: nothing of the document computed again
        assert report.prefill_s_spent == 0 and all(c.store_hit for c in report.caches)
        assert [a.status for a in report.agents] == ["succeeded"] * 2
    passes = [n for counter in counters for n in counter.tokens]
    assert passes and max(passes) < doc_tokens  # only suffixes (instructions, question, upstream) and decoding
    suffixes = sum(a.suffix_tokens for r in s.reports for a in r.agents)
    assert sum(passes) < suffixes + 10 * 2 * 3 + 1  # each agent's suffix once, then its decoded tokens
    pipeline.close()


def test_a_named_session_reopens_in_a_new_pipeline_with_its_document_and_history(fam, mapstore, tmp_path):
    first = _pipeline(fam, mapstore, tmp_path)
    with first.session(DOC, name="licence") as s:
        s.ask("Who?")
    first.close()
    again = _pipeline(fam, mapstore, tmp_path)  # a later process: the session file and the disk tier remain
    reopened = again.session(name="licence")
    assert reopened.document == DOC and reopened.history[0]["inputs"] == {"question": "Who?"}

    async def ask() -> str:
        async with reopened as s:
            assert all(lease.loaded_tokens for lease in s.held)  # every member's document cache came from disk
            return await s.aask("What may I copy?")

    assert anyio.run(ask)
    report = reopened.reports[-1]
    assert report.prefill_s_spent == 0 and report.disk_loads == 0  # held at open: read from disk then
    assert len(reopened.history) == 2
    with pytest.raises(SessionError, match="no session named 'other'"):
        again.session(name="other")
    with pytest.raises(SessionError, match="session name"):
        again.session(DOC, name="../escape")
    with pytest.raises(SessionError, match="closed"):
        reopened.run_sync({"question": "x"})
    again.close()


def test_ask_needs_a_question_input(fam, mapstore, tmp_path):
    pipeline = (Pipeline("plain", source="base", models={"base": str(fam.parent)}, default_device="cpu",
                         mapping={"directory": str(mapstore.directory)})
                .agent({"name": "a", "task": "Summarise.", "generation": {"max_new_tokens": 2}}, model="base"))
    with pipeline.session(DOC) as s, pytest.raises(SessionError, match="declare it"):
        s.ask("Who?")
    pipeline.close()


def _chunked(fam, mapstore, tmp_path) -> Pipeline:
    return (Pipeline("long", source="base", models={"base": str(fam.parent), "child": str(fam.child)},
                     mapping={"directory": str(mapstore.directory), "on_missing": "calibrate"}, default_device="cpu",
                     home=str(tmp_path / "home"), kv_store={"enabled": False},
                     gate={"offline": None, "probe": None}, chunking={"overlap_tokens": 16})
            .with_input("question")
            .agent({"name": "notes", "task": "Note what answers: {question}", "generation": {"max_new_tokens": 3}},
                   model="child", per_chunk=True)
            .agent({"name": "answer", "task": "Answer {question} from {notes}", "generation": {"max_new_tokens": 3}},
                   model="base"))


def test_a_session_holds_a_document_longer_than_a_window_chunk_by_chunk(fam, mapstore, tmp_path):
    long_doc = data_text("gpl-3.txt")[:1500]  # several of the tiny models' 512-position windows
    pipeline = _chunked(fam, mapstore, tmp_path)
    with pipeline.session(long_doc, input_tokens=24) as s:
        held = s.held
        first = s.run_sync({"question": "Who?"})
        chunks = len(first.chunks)
        assert chunks >= 3
        # each chunk on the source and on the per-chunk agent's member; the reduce agent's notes are per run
        assert len(held) == 2 * chunks
        longest = "And what may I copy?"  # within the 24 tokens the session keeps for a question
        counter = TokenCounter(pipeline.orchestra().cache.executor.model("base").model)
        try:
            later = s.run_sync({"question": longest})  # a longer question: the held chunks still serve it
        finally:
            counter.remove()
    for report in (first, later):
        assert report.succeeded == ["notes", "answer"], [a.error for a in report.agents]
        assert all(c.source_prefill_s == 0 for c in report.chunks)  # the held caches: nothing prefilled again
        assert all(c.prefill_s_spent == 0 and c.cache_path == "mapped" for c in report.agent("notes").chunks)
    assert [(c.start, c.end) for c in later.chunks] == [(c.start, c.end) for c in first.chunks]
    assert max(counter.tokens) < min(c.tokens for c in later.chunks)  # no chunk computed again on the source
    too_long = " ".join(["why"] * 200)
    with pipeline.session(long_doc, input_tokens=24) as s, pytest.raises(DocumentError, match="held .* input_tokens"):
        s.run_sync({"question": too_long})
    assert not pipeline.orchestra()._held_windows  # closing the session lets the document's cut go
    pipeline.close()
