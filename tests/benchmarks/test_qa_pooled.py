"""benchmarks/qa_pooled.py: both question sets pooled, every goal read against its interval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.conftest import ROOT, load_script

RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def qp():
    return load_script("qa_pooled")


def test_the_committed_table_is_what_the_script_makes_of_the_committed_results(qp, tmp_path: Path):
    assert qp.main(["--out", str(tmp_path)]) == 0
    made = json.loads((tmp_path / "qa_pooled.json").read_text())["results"]
    committed = json.loads((RESULTS / "qa_pooled.json").read_text())["results"]
    assert made == committed
    md = (tmp_path / "qa_pooled.md").read_text()
    assert md.count("\n| finetuned |") == len(made) and md.count("\n## ") == len(made)


def test_pooling_keeps_each_sets_questions_apart_and_counts_every_answer(qp):
    paths = [RESULTS / f for f in qp.DEFAULT_GROUPS["512 tokens, built-in repair"]]
    sections = [qp.load_section(p) for p in paths]
    row = qp.pooled_member(sections, "finetuned")
    own = [a for k in sections for a in k.answers if a.member == "finetuned" and a.condition == "own"]
    mapped = [a for k in sections for a in k.answers if a.member == "finetuned" and a.condition == "mapped"]
    assert row["own"]["n"] == len(own) == sum(k.questions for k in sections)
    assert row["own"]["correct"] == sum(a.correct for a in own)
    assert row["mapped"]["correct"] == sum(a.correct for a in mapped)
    # retention is recomputed from the pooled answers: right on the map over right on the own prefill
    assert row["mapped"]["retention"] == pytest.approx(row["mapped"]["correct"] / row["own"]["correct"])
    assert row["own"]["correct"] - row["mapped"]["lost"] + row["mapped"]["gained"] == row["mapped"]["correct"]
    g = row["gates"]
    assert g["harmed"] == sum(next(x for x in k.gates if x.member == "finetuned").harmed for k in sections)
    assert g["windows"] == g["harmed"] + g["unharmed"]


@pytest.mark.parametrize(("low", "high", "goal", "at_most", "expected"), [
    (0.96, 1.02, 0.95, False, "met"),
    (0.64, 0.93, 0.95, False, "not met"),
    (0.64, 1.03, 0.95, False, "open"),
    (0.02, 0.13, 0.20, True, "met"),
    (0.25, 0.40, 0.20, True, "not met"),
    (0.07, 0.24, 0.20, True, "open"),
    (None, None, 0.95, False, "-"),
])
def test_a_goal_is_met_only_when_its_whole_interval_clears_it(qp, low, high, goal, at_most, expected):
    assert qp.verdict(low, high, goal, at_most=at_most) == expected


def test_questions_needed_grow_with_the_square_of_the_width(qp):
    assert qp.questions_for(0.05, 100, (0.80, 0.90)) == 100
    assert qp.questions_for(0.05, 100, (0.70, 0.90)) == 400
    assert qp.questions_for(0.05, 100, None) is None


def test_a_missing_input_exits_2_naming_the_command_that_makes_it(qp, tmp_path: Path, capsys):
    missing = tmp_path / "nope.json"
    assert qp.main(["--group", f"x={missing}", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "orchestra bench --sections tasks" in err[0] and str(missing) in err[0]


def test_a_group_without_files_is_refused(qp):
    with pytest.raises(Exception, match="LABEL=a.json,b.json"):
        qp.parse_group("no files here")
