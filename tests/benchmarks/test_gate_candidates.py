"""benchmarks/gate_candidates.py: thresholds tuned on one tasks result, applied unchanged to another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.conftest import ROOT, load_script

RESULTS = ROOT / "benchmarks" / "results"
TUNE, TEST = RESULTS / "qa_faithful.json", RESULTS / "qa_faithful_heldout.json"


@pytest.fixture(scope="module")
def gc():
    return load_script("gate_candidates")


def test_the_committed_table_is_what_the_script_makes_of_the_committed_results(gc, tmp_path: Path):
    assert gc.main(["--tune", str(TUNE), "--test", str(TEST), "--out", str(tmp_path)]) == 0
    made = json.loads((tmp_path / "gate_candidates.json").read_text())["rows"]
    committed = json.loads((RESULTS / "gate_candidates.json").read_text())["rows"]
    assert made == committed
    assert (tmp_path / "gate_candidates.md").read_text().count("\n| finetuned |") == sum(
        r["member"] == "finetuned" for r in made)


def test_a_threshold_tuned_on_one_set_is_the_one_the_other_is_scored_at(gc):
    rows = gc.compare(TUNE, TEST)
    assert {r["member"] for r in rows} == {"finetuned", "int8"}
    for r in rows:
        if r["tune"]["threshold"] is not None and r["test"] is not None:
            assert r["test"]["threshold"] == r["tune"]["threshold"], r["signal"]
    # the test set's rates are recomputed from its own answers at that threshold, not copied from the tuning set
    answer_f1 = next(r for r in rows if r["member"] == "finetuned" and r["signal"] == "answer_differs_source")
    test_rows = gc.judged(TEST, "finetuned")
    t = answer_f1["test"]["threshold"]
    harmed = [j for j in test_rows if j.harmed and "answer_differs_source" in j.signals]
    caught = sum(j.signals["answer_differs_source"] >= t for j in harmed)
    assert answer_f1["test"]["catch_rate"] == pytest.approx(caught / len(harmed))


def test_a_missing_input_exits_2_naming_the_command_that_makes_it(gc, tmp_path: Path, capsys):
    missing = tmp_path / "nope.json"
    assert gc.main(["--tune", str(missing), "--test", str(TEST), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "orchestra bench --sections tasks" in err[0] and str(missing) in err[0]


def test_a_result_without_a_tasks_section_is_named(gc, tmp_path: Path):
    bare = tmp_path / "bare.json"
    data = json.loads(TUNE.read_text())
    data["tasks"] = None
    bare.write_text(json.dumps(data))
    assert gc.members_of(bare) == []
    with pytest.raises(SystemExit, match="has no tasks section"):
        gc.judged(bare, "finetuned")


def test_several_results_on_one_side_are_pooled_and_written_under_the_name_given(gc, tmp_path: Path):
    assert gc.main(["--tune", str(TUNE), str(TEST), "--test", str(TEST), "--out", str(tmp_path),
                    "--name", "pooled"]) == 0
    rows = json.loads((tmp_path / "pooled.json").read_text())["rows"]
    assert not (tmp_path / "gate_candidates.json").exists()
    assert "`qa_faithful.json` + `qa_faithful_heldout.json`" in (tmp_path / "pooled.md").read_text()
    for member in ("finetuned", "int8"):
        row = next(r for r in rows if r["member"] == member and r["signal"] == "answer_differs_source")
        one, other = gc.judged(TUNE, member), gc.judged(TEST, member)
        assert row["tune"]["questions"] == len([*one, *other]) == row["pooled"]["questions"] - len(other)
        assert row["tune"]["harmed"] == sum(j.harmed for j in [*one, *other])
