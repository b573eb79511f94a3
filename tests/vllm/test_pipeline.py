"""Pipelines on vLLM (``executor: vllm``): one engine per member, the document computed once on the source's
engine and loaded mapped, gated, into the other member's, every agent decoded by its member's engine, and
what vLLM cannot apply said in the report."""

from __future__ import annotations

import shutil

import pytest

from orchestra import Pipeline

# short: the tiny family's tokenizer spends about a token a character, and its engines serve 512 positions
DOCUMENT = "Revenue grew in every region last year. The board approved a dividend in May."


@pytest.fixture(scope="module")
def run(calibrated_family: dict, tmp_path_factory: pytest.TempPathFactory):
    from orchestra.family import load_family

    home = tmp_path_factory.mktemp("pipeline") / "home"  # a store of its own: nothing computed yet
    shutil.copytree(calibrated_family["home"], home, ignore=shutil.ignore_patterns("kv"))
    family = load_family(home)
    events: list = []
    pipeline = (
        Pipeline("on-vllm", family=family, models={"base": "base", "tuned": "tuned"}, source="base",
                 executor={"kind": "vllm", "vllm": {"args": ["--max-model-len", "512", "--enforce-eager"]}})
        # sampled: the tiny model's greedy reply to a chat turn is blank, which the degenerate check refuses
        .agent({"name": "notes", "task": "Write one sentence about the report.",
                "generation": {"max_new_tokens": 12, "temperature": 1.0, "seed": 1}}, model="base")
        .agent("key_facts", model="tuned", max_facts=1, max_new_tokens=8, max_repairs=0)
        .agent({"name": "review", "task": "Notes: {notes}\nCheck the notes.", "generation": {"max_new_tokens": 10,
                "no_repeat_ngram_size": 3, "temperature": 1.0, "seed": 1}}, model="base")
    )
    try:
        report = pipeline.run_sync(DOCUMENT, on_event=events.append)
    finally:
        pipeline.close()
    return report, events


def test_the_document_is_computed_once_and_mapped_into_the_other_members_engine(run) -> None:
    report, _ = run
    assert report.executor == "vllm"
    assert {a.name: a.status for a in report.agents} == {"notes": "succeeded", "key_facts": "succeeded",
                                                          "review": "succeeded"}, \
        [(a.name, a.status, a.error, a.degenerate_reason, (a.output or "")[:200]) for a in report.agents]
    exact = [c for c in report.caches if c.path == "exact"]
    assert [c.model for c in exact] == ["base"]  # the source's engine computed the document, once
    facts = report.agent("key_facts")
    assert facts.cache_path == "mapped", facts
    assert facts.gate and all(g["passed"] for g in facts.gate), facts.gate
    assert report.agent("review").cache_path == "exact"  # the source's own cache, held in its engine


def test_agents_keep_their_grammar_and_the_report_says_what_vllm_could_not_apply(run) -> None:
    from agents.grounding import document_sentences

    report, events = run
    facts = report.agent("key_facts")
    assert facts.parsed is not None and len(facts.parsed["facts"]) == 1  # a finished JSON past its 8 tokens
    assert set(facts.parsed["facts"]) <= set(document_sentences(DOCUMENT))  # grounded: the document's sentences
    assert any(n.startswith("distinct list items") for n in facts.not_applied), facts.not_applied
    assert any(n.startswith("no_repeat_ngram_size=3") for n in report.agent("review").not_applied)
    assert report.agent("notes").not_applied == []
    tokens = [e for e in events if e.kind == "token" and e.agent == "notes"]
    assert tokens and "".join(e.text for e in tokens).strip()  # streamed from the engine as it decoded
