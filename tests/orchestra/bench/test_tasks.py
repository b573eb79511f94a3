"""The tasks section: the QA set's validity, its scoring, and the QA table end to end on the tiny family home."""

from __future__ import annotations

import shutil

import pytest

from orchestra.bench.qa import is_correct, load_qa, normalize, passage_window
from tests.orchestra.bench.conftest import TINY_QUESTIONS, tiny_qa_file


# -- the QA set -----------------------------------------------------------------------------------
def test_qa_set_is_large_unique_and_inside_its_documents():
    from orchestra.family.corpus import data_text

    qa = load_qa()
    assert len(qa.questions) >= 40 and qa.version >= 1
    assert len({q.id for q in qa.questions}) == len(qa.questions)
    assert len({p.id for p in qa.passages}) == len(qa.passages)
    docs = {p.document for p in qa.passages}
    assert docs == {"gpl-3.txt", "apache-2.0.txt", "mpl-2.0.txt", "gfdl-1.3.txt"}
    for p in qa.passages:
        text = data_text(p.document)
        assert 0 <= p.start < p.end <= len(text), p.id
        assert p.end - p.start <= 1500, f"{p.id}: a passage must fit a small window"
    used = {q.passage for q in qa.questions}
    assert used == {p.id for p in qa.passages}, "every passage has questions"
    assert {q.type for q in qa.questions} >= {"date", "number", "duration", "name", "term", "title"}


def test_every_reference_answer_occurs_in_its_passage():
    qa = load_qa()
    for q in qa.questions:
        window = qa.passage_text(q.passage)
        flat = " ".join(window.split()).lower()
        # the first reference literally (case and line breaks aside); every variant after normalisation
        assert q.answers[0].lower() in flat, (q.id, q.answers[0])
        for ref in q.answers:
            assert is_correct(window, [ref]), (q.id, ref)
        # and not trivially: the question itself does not give the (first) answer away
        assert not is_correct(q.question, q.answers[:1]), q.id


def test_bundled_demo_document_is_the_gpl_text():
    """The demo's document is GPL-3 sections 0-7: the QA set's gpl-3 passages before section 8 lie in it too."""
    from pathlib import Path

    demo = Path(__file__).parents[3] / "examples" / "long_document_analysis" / "document.txt"
    if not demo.is_file():
        pytest.skip("examples/ not in this checkout")
    qa = load_qa()
    flat = " ".join(demo.read_text().split())
    inside = [p.id for p in qa.passages if p.document == "gpl-3.txt" and " ".join(qa.passage_text(p.id).split()) in flat]
    assert len(inside) >= 8, inside


# -- scoring --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("prediction", "references", "expected"), [
    ("The license was published on 29 June 2007.", ["29 June 2007"], True),
    ("June 29, 2007", ["29 June 2007"], True),
    ("It is dated June 29th 2007", ["29 June 2007"], True),
    ("29 June 2008", ["29 June 2007"], False),
    ("within sixty days", ["60 days"], True),
    ("60 days", ["sixty days"], True),
    ("600 days", ["60 days"], False),  # whole words only
    ("at most twenty-five words", ["25 words"], True),
    ("fifty percent (50%) or more", ["50%"], True),
    ("Fifty Percent", ["50%"], True),
    ("Version 2.0", ["2.0"], True),
    ("Version 2", ["2.0"], False),
    ("version 2.1", ["2.0"], False),
    ("The document does not say.", ["Free Software Foundation"], False),
    ("the Free  Software\nFoundation, Inc.", ["Free Software Foundation"], True),
    ("Protecting Users’ Legal Rights", ["Protecting Users' Legal Rights"], True),  # curly apostrophe
    ("http://www.apache.org/licenses/LICENSE-2.0", ["apache.org/licenses/LICENSE-2.0"], True),
    ("the GNU LGPL", ["Lesser General Public License", "LGPL"], True),
    ("", ["2007"], False),
    ("anything", [""], False),  # an empty reference never matches
])
def test_is_correct(prediction, references, expected):
    assert is_correct(prediction, references) is expected


def test_normalize():
    assert normalize("Sixty days, twenty-five WORDS; one hundred copies") == "60 days 25 words 100 copies"
    assert normalize("Users' Légal  Rights") == "users legal rights"
    assert normalize("November 1, 2008") == normalize("1 November 2008") == "1 november 2008"
    assert normalize("50%") == "50 percent"


def test_passage_window_keeps_the_passage_and_sizes_the_rest():
    from transformers import AutoTokenizer

    from orchestra.family import load_family

    try:
        tok = AutoTokenizer.from_pretrained(load_family().member_path("root"))
    except Exception:  # no bundled family here: any fast tokenizer will do
        from tests.tiny_family import make_tokenizer

        tok = make_tokenizer()
    qa = load_qa()
    for pid in ("gpl3-header", "gpl3-termination", "gfdl-eligible"):
        p = qa.passage(pid)
        doc = qa.document_text(p.document)
        passage = doc[p.start : p.end]
        own = len(tok(passage, add_special_tokens=False)["input_ids"])
        for n in (8, 256, 1024):
            text, tokens = passage_window(doc, p.start, p.end, n, tok)
            assert passage in text, (pid, n)
            assert tokens >= min(n, len(tok(doc, add_special_tokens=False)["input_ids"]))
            assert tokens <= max(n, own + 2), (pid, n, tokens)  # never more than asked, unless the passage is longer
    # at the start of a document the window is shifted right, not cut
    p = qa.passage("gpl3-header")
    text, tokens = passage_window(qa.document_text(p.document), p.start, p.end, 512, tok)
    assert tokens == 512 and qa.document_text(p.document).startswith(text)


# -- the section end to end on the tiny family home ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_qa(tiny_family_home, tmp_path_factory):
    """`orchestra bench --sections tasks --out <tmp>/qa.json` on a copy of the tiny family home."""
    import torch

    from orchestra.bench import BenchConfig, BenchFamily, run_bench

    home = tmp_path_factory.mktemp("qa-home") / "home"
    shutil.copytree(tiny_family_home, home)  # its mapping store is filled by this run: keep the shared home clean
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is far faster on a busy machine
    try:
        fam = BenchFamily.bundled(home, calibration_tokens=512)
        config = BenchConfig(sections=["tasks"], task_tokens=40, task_max_new_tokens=8, tail_tokens=8,
                             qa_lengths=[40, 64], qa_repair_budget=0.25, qa_questions=TINY_QUESTIONS,
                             qa_file=str(tiny_qa_file(home.parent / "tiny-qa.json", TINY_QUESTIONS)))
        out = home.parent / "results" / "qa.json"
        result = run_bench(config, out, family=fam, command="tiny qa", progress=False)
    finally:
        torch.set_num_threads(threads)
    return result, out, fam


def test_tasks_only_run_writes_its_own_files(tiny_qa):
    from orchestra.bench import BenchResults

    result, out, _ = tiny_qa
    assert out.is_file() and out.with_suffix(".md").is_file()
    assert not (out.parent / "bench.json").exists() and not (out.parent / "bench.md").exists()
    loaded = BenchResults.model_validate_json(out.read_text())
    assert loaded == result and set(loaded.section_seconds) == {"tasks"}
    assert loaded.quality is None and loaded.timing is None
    md = out.with_suffix(".md").read_text()
    assert "## Task level: question answering" in md and "| member | n | own | mapped | mapped+repair | plain |" in md
    assert "| root (source) |" in md and "| plain prompt |" in md
    assert "own-prefill accuracy vs window length" in md


def test_every_member_answers_under_every_condition_on_the_lease_it_was_given(tiny_qa):
    result, _, fam = tiny_qa
    k = result.tasks
    assert k is not None and k.questions == len(TINY_QUESTIONS) and not k.skipped
    members = [a for a in fam.aliases if a != "root"]
    manifest = {r.role for r in fam.family.members.values()} - {"root"}
    assert set(members) == manifest and members[:4] == ["finetuned", "int8", "quantized", "distilled"]  # every member
    assert k.config.source == "root" and k.config.members == members
    # one answer per question, member and condition; the source answers once, and every member the plain way
    assert len(k.answers) == len(TINY_QUESTIONS) * (1 + 3 * len(members) + 1 + len(members))
    for m in members:
        for cond, path in (("own", {"exact"}), ("mapped", {"mapped"}), ("mapped+repair", {"mapped"})):
            rows = [a for a in k.answers if a.member == m and a.condition == cond]
            assert {a.question for a in rows} == set(TINY_QUESTIONS), (m, cond)
            # the path recorded is the FamilyCache lease's: the mapped conditions really ran on a mapped cache
            assert {a.path for a in rows} == path, (m, cond)
            assert k.score(m, cond).paths == {next(iter(path)): len(TINY_QUESTIONS)}
    src = [a for a in k.answers if a.condition == "source"]
    assert {a.member for a in src} == {"root"} and {a.path for a in src} == {"exact"}
    plain = [a for a in k.answers if a.condition == "plain"]
    assert {(a.member, a.question) for a in plain} == {(m, q) for m in ["root", *members] for q in TINY_QUESTIONS}
    for a in k.answers:
        assert a.correct == (a.error is None and is_correct(a.prediction, _refs(a.question)))
        if a.condition != "plain":  # the plain prompt shares no prefix
            assert a.prefix_tokens > a.window_tokens > 0


def test_the_section_records_the_mapping_each_members_answers_ran_on(tiny_qa):
    result, out, fam = tiny_qa
    k = result.tasks
    members = [a for a in fam.aliases if a != "root"]
    assert set(k.mappings) == set(members)
    for m in members:
        stored = fam.mapping(fam_pair(m)).manifest
        used = k.mappings[m]
        # the run calibrated the store on its own 512 tokens, not the family default: the record says so
        assert used.calibration_tokens == stored.calibration.token_count == 512
        assert (used.method, used.created_at) == (stored.method.name, stored.created_at)
    md = out.with_suffix(".md").read_text()
    assert f"Mappings the mapped answers ran on: {members[0]} {k.mappings[members[0]].method} on 512 tokens" in md


def fam_pair(member: str):
    from orchestra.bench import Pair

    return Pair(source="root", target=member)


def test_the_plain_baseline_is_one_user_turn_of_the_document_then_the_question(tiny_qa):
    """What a user would try without orchestra: the chat template over one user turn, nothing of orchestra's."""
    from agents.prompt import CHAT_DOCUMENT_INTRO, DOCUMENT_START, SYSTEM_MESSAGE
    from orchestra.bench.tasks import plain_prompt_ids

    fam = tiny_qa[2]
    tok = fam.loaded("root").tokenizer
    text = tok.decode(plain_prompt_ids(tok, "The licence was published in 2007.", "When was it published?"))
    between = "\n\n" if tok.chat_template else "\n\nQuestion: "  # a tokenizer without a template: a plain Q/A text
    assert f"The licence was published in 2007.{between}When was it published?" in text
    for ours in (SYSTEM_MESSAGE, CHAT_DOCUMENT_INTRO.strip(), DOCUMENT_START.strip()):
        assert ours not in text
    if tok.chat_template:
        assert text.rstrip().endswith(tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                               add_generation_prompt=True).split("x")[-1].rstrip())


def _refs(qid: str) -> list[str]:
    return next(q.answers for q in load_qa().questions if q.id == qid)


def test_accuracy_and_retention_are_computed_from_the_answers(tiny_qa):
    k = tiny_qa[0].tasks
    assert k is not None
    for s in k.scores:
        rows = [a for a in k.answers if a.member == s.member and a.condition == s.condition]
        assert s.n == len(rows) and s.correct == sum(a.correct for a in rows)
        assert s.accuracy == pytest.approx(s.correct / s.n)
        if s.condition in ("mapped", "mapped+repair"):
            own = k.score(s.member, "own")
            assert s.retention == (pytest.approx(s.accuracy / own.accuracy) if own.correct else None)
            own_answers = {a.question: normalize(a.prediction) for a in k.answers
                           if a.member == s.member and a.condition == "own"}
            same = sum(own_answers[a.question] == normalize(a.prediction) for a in rows)
            assert s.agreement == pytest.approx(same / s.n)
        else:
            assert s.retention is None
    assert {(s.member, s.condition) for s in k.scores} >= {("root", "source"), ("finetuned", "mapped+repair"),
                                                           ("root", "plain"), ("finetuned", "plain")}


def test_gate_decisions_are_reported_per_window(tiny_qa):
    k = tiny_qa[0].tasks
    assert k is not None
    assert [g.member for g in k.gates] == k.config.members
    for g in k.gates:
        assert g.windows == k.passages and g.passed + g.fell_back == g.windows
        assert sum(g.failed_gates.values()) == g.fell_back
        assert set(g.failed_gates) <= {"offline", "probe", "mapping", "other"}
        assert 0 <= g.harmed <= g.changed <= g.windows
        assert (g.catch_rate is None) == (g.harmed == 0)
        assert (g.false_alarm_rate is None) == (g.harmed == g.windows)
        mapped = k.score(g.member, "mapped")
        assert mapped.agreement is not None and mapped.agreement_f1 is not None
        assert mapped.agreement <= mapped.agreement_f1 <= 1.0  # an identical answer scores F1 1


def test_token_f1_counts_shared_words_of_two_answers():
    from orchestra.bench.tasks import token_f1

    assert token_f1("version 2.0", "version 2.0.") == 1.0
    assert 0.5 < token_f1("version 2.0", "It is version 2.0") < 1.0  # every reference word, and more
    assert token_f1("30 days", "3 years") == 0.0
    assert token_f1("", "") == 1.0


def test_the_gates_catch_rate_counts_harmed_windows_they_refused():
    from types import SimpleNamespace

    from orchestra.bench.tasks import QAAnswer, _gate_summary, _GateWindow

    def answer(q: str, condition: str, prediction: str, correct: bool) -> QAAnswer:
        return QAAnswer(question=q, member="tuned", condition=condition, window_tokens=512, prefix_tokens=530,
                        prediction=prediction,
                        correct=correct, path="mapped" if condition == "mapped" else "exact")

    def window(questions: tuple[str, ...], refused: bool) -> _GateWindow:
        lease = SimpleNamespace(path="reprefilled" if refused else "mapped", gates=[], fallback_reason=None)
        return _GateWindow(lease, questions)  # type: ignore[arg-type]

    answers = [answer("a", "own", "2.0", True), answer("a", "mapped", "1.0", False),  # harmed, refused: caught
               answer("b", "own", "3 years", True), answer("b", "mapped", "30 days", False),  # harmed, passed: missed
               answer("c", "own", "GPL", True), answer("c", "mapped", "GPL", True),  # same, refused: false alarm
               answer("d", "own", "x", False), answer("d", "mapped", "y", False)]  # changed, not harmed, passed
    g = _gate_summary("tuned", [window(("a",), True), window(("b",), False), window(("c",), True),
                                window(("d",), False)], answers)
    assert (g.harmed, g.changed, g.fell_back) == (2, 3, 2)
    assert (g.catch_rate, g.false_alarm_rate) == (0.5, 0.5)
    assert g.changed_catch_rate == pytest.approx(1 / 3)
    # one caught of two harmed windows: the interval says how little two windows show
    assert g.catch_interval is not None and g.catch_interval[0] < 0.15 and g.catch_interval[1] > 0.85
    assert g.false_alarm_interval is not None and g.false_alarm_interval[0] < 0.5 < g.false_alarm_interval[1]


def test_a_mapped_score_counts_lost_and_gained_questions_with_intervals():
    from orchestra.bench.tasks import QAAnswer, score_answers

    def answer(q: str, condition: str, prediction: str, correct: bool) -> QAAnswer:
        return QAAnswer(question=q, member="tuned", condition=condition, window_tokens=512, prefix_tokens=530,
                        prediction=prediction, correct=correct, path="mapped" if condition == "mapped" else "exact")

    own = {q: answer(q, "own", p, c) for q, p, c in
           [("a", "2.0", True), ("b", "3 years", True), ("c", "GPL", True), ("d", "x", False)]}
    mapped = [answer("a", "mapped", "1.0", False), answer("b", "mapped", "3 years", True),
              answer("c", "mapped", "the GPL", True), answer("d", "mapped", "MIT", True)]
    s = score_answers("tuned", "mapped", mapped, own)
    assert (s.correct, s.lost, s.gained) == (3, 1, 1)
    assert s.retention == pytest.approx(1.0)
    assert s.agreement == pytest.approx(0.25)  # only b reads the same; "the GPL" is not "GPL"
    assert s.retention_interval is not None and s.retention_interval[0] < 1.0 < s.retention_interval[1]
    assert s.agreement_interval is not None and s.agreement_interval[0] < 0.25 < s.agreement_interval[1]
    own_score = score_answers("tuned", "own", list(own.values()))
    assert own_score.lost is None and own_score.retention_interval is None


def test_window_length_sweep(tiny_qa):
    k = tiny_qa[0].tasks
    assert k is not None
    assert [r.length for r in k.lengths] == [40, 64] and all(r.member == "root" for r in k.lengths)
    for r in k.lengths:
        assert r.n + r.skipped == len(TINY_QUESTIONS)
        assert r.accuracy == pytest.approx(r.correct / r.n if r.n else 0.0)
        assert len(r.correct_ids) == r.correct
        assert r.plain_accuracy is not None and 0.0 <= r.plain_accuracy <= 1.0
    # the main table's window (64) asked again: the same exact cache and prompt, so the same answers
    main = {a.question: a.correct for a in k.answers if a.condition == "source"}
    assert set(k.lengths[0].correct_ids) == {q for q, ok in main.items() if ok}
    assert k.lengths[1].mean_window_tokens >= k.lengths[0].mean_window_tokens


def test_cli_exposes_the_qa_options():
    from typer.testing import CliRunner

    from orchestra.cli import app

    result = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in ("--qa-window", "--qa-lengths", "--qa-limit", "--qa-questions", "--qa-repair-budget"):
        assert option in result.output, option


def test_every_mapped_answer_carries_the_candidate_gates_readings(tiny_qa):
    from orchestra.bench.gate_signals import SIGNALS

    k = tiny_qa[0].tasks
    assert k is not None
    for a in k.answers:
        if a.condition != "mapped":
            assert a.signals == {}
            continue
        assert {"start_kl_source", "start_top1_miss_source", "oracle_start_kl_own"} <= set(a.signals)
        assert all(v == v for v in a.signals.values())  # no NaN
        if a.error is None:  # every decoded answer has at least its end token: its tie and loss are read
            assert a.signals["answer_tie"] <= 0.0 and a.signals["answer_nll"] >= 0.0
    for g in k.gates:
        names = [c.signal for c in g.candidates]
        assert set(names) <= {s.name for s in SIGNALS} and "answer_differs_source" in names
        for c in g.candidates:
            assert c.questions == k.score(g.member, "mapped").n and c.harmed <= c.changed <= c.questions
            assert (c.threshold is None) == (c.harmed == 0)
    md = tiny_qa[1].with_suffix(".md").read_text()
    assert "### Which reading notices that the map harmed an answer" in md


def test_a_question_focused_repair_repairs_each_question_on_what_it_reads(tiny_family_home, tmp_path):
    """`repair_focus: question`: one repaired cache per question, its interior tokens ranked by that question."""
    import torch

    from orchestra.bench import BenchFamily
    from orchestra.bench.tasks import TaskConfig, run_tasks, tasks_markdown

    home = tmp_path / "home"
    shutil.copytree(tiny_family_home, home)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fam = BenchFamily.bundled(home, calibration_tokens=512)
        config = TaskConfig(source="root", members=["finetuned"], window_tokens=40, max_new_tokens=4, tail_tokens=8,
                            repair_budget=0.5, repair_focus="question", questions=TINY_QUESTIONS[:3], plain=False,
                            qa_file=str(tiny_qa_file(tmp_path / "tiny-qa.json", TINY_QUESTIONS)))
        k = run_tasks(config, fam, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert k.repair is not None and k.repair["scattered_share"] == 1.0
    repaired = [a for a in k.answers if a.condition == "mapped+repair"]
    assert len(repaired) == 3 and all(a.path == "mapped" for a in repaired)
    assert len(k.repair_costs) == 3  # one repair per question, not per window
    assert all(c > 0.0 for c in k.repair_costs)  # priced with the recomputed tail, on a 40-token window
    assert any("each question reads" in line for line in tasks_markdown(k))
