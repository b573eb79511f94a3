"""The held-out QA set (``qa_heldout.json``): loadable by its bare name, answerable from its passages, and on
documents that neither the calibration corpus nor the first QA set uses."""

from __future__ import annotations

import json

from orchestra.bench.qa import HELDOUT_QA_FILE, QA_FILE, is_correct, load_qa
from orchestra.documents.texts import CALIBRATION_TEXTS, HELDOUT_TEXT, data_text


def test_held_out_set_loads_by_its_bare_name():
    heldout = load_qa(HELDOUT_QA_FILE)
    assert HELDOUT_QA_FILE == "qa_heldout.json"
    assert heldout.name == "orchestra-license-qa-heldout" and heldout.version >= 1
    assert load_qa(QA_FILE) == load_qa(), "the first set's bare name is the bundled default"
    assert heldout.name != load_qa().name


def test_a_file_on_disk_wins_over_a_bundled_name(tmp_path, monkeypatch):
    mine = load_qa().model_dump()
    mine["name"] = "mine"
    (tmp_path / HELDOUT_QA_FILE).write_text(json.dumps(mine))
    monkeypatch.chdir(tmp_path)
    load_qa.cache_clear()
    try:
        assert load_qa(HELDOUT_QA_FILE).name == "mine"
    finally:
        load_qa.cache_clear()


def test_held_out_passages_lie_inside_their_documents_and_all_have_questions():
    qa = load_qa(HELDOUT_QA_FILE)
    assert len({q.id for q in qa.questions}) == len(qa.questions)
    for p in qa.passages:
        text = data_text(p.document)
        assert 0 <= p.start < p.end <= len(text), p.id
        assert p.end - p.start <= 1500, f"{p.id}: a passage must fit a small window"
    assert {q.passage for q in qa.questions} == {p.id for p in qa.passages}, "every passage has questions"
    assert {q.type for q in qa.questions} >= {"date", "number", "duration", "name", "term", "title"}


def test_every_held_out_reference_answer_occurs_in_its_passage():
    qa = load_qa(HELDOUT_QA_FILE)
    for q in qa.questions:
        passage = qa.passage_text(q.passage)
        flat = " ".join(passage.split()).lower()
        # the first reference literally (case and line breaks aside); every variant normalised, as whole words
        assert q.answers[0].lower() in flat, (q.id, q.answers[0])
        for ref in q.answers:
            assert is_correct(passage, [ref]), (q.id, ref)
        # and the question does not give its answer away
        assert not any(is_correct(q.question, [ref]) for ref in q.answers), q.id


def test_held_out_documents_are_neither_calibration_texts_nor_in_the_first_set():
    heldout_docs = {p.document for p in load_qa(HELDOUT_QA_FILE).passages}
    first_docs = {p.document for p in load_qa().passages}
    assert heldout_docs == {"lgpl-2.1.txt", "gpl-2.txt", "mpl-1.1.txt", "artistic.txt"}
    assert not heldout_docs & set(CALIBRATION_TEXTS)
    assert HELDOUT_TEXT not in heldout_docs
    assert not heldout_docs & first_docs


def test_held_out_set_is_large_and_doubles_the_questions():
    heldout, first = load_qa(HELDOUT_QA_FILE), load_qa()
    assert len(heldout.questions) >= 60
    assert len(heldout.questions) + len(first.questions) >= 120
    assert not {q.id for q in heldout.questions} & {q.id for q in first.questions}
    assert not {p.id for p in heldout.passages} & {p.id for p in first.passages}
