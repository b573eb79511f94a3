"""Pure helpers and configuration: no model needed."""

from __future__ import annotations

import math

import pytest


def test_rouge_l_known_values():
    from orchestra.bench.tasks import lcs_length, rouge_l

    assert lcs_length("a b c d".split(), "a c d e".split()) == 3
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("", "") == 1.0 and rouge_l("a b", "") == 0.0 and rouge_l("a b", "c d") == 0.0
    # LCS 3 of 4 reference and 4 candidate words: P = R = 0.75
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)
    assert rouge_l("A  b", "a B") == 1.0  # case and whitespace do not count


def test_loglog_slope():
    from orchestra.bench.timing import loglog_slope

    assert loglog_slope([512, 1024, 2048], [1.0, 2.0, 4.0]) == pytest.approx(1.0)
    assert loglog_slope([512, 1024], [1.0, 4.0]) == pytest.approx(2.0)
    assert loglog_slope([512], [1.0]) is None
    assert math.isclose(loglog_slope([1, 2, 4], [3, 3, 3]) or 0.0, 0.0, abs_tol=1e-12)


def test_pairs_parse_and_reject():
    from orchestra.bench import Pair, parse_pairs

    assert parse_pairs(["root>finetuned,finetuned->root", "root>finetuned"]) == [
        Pair(source="root", target="finetuned"), Pair(source="finetuned", target="root")]
    for bad in ("root", "root>root", ">x", "a>b>c"):
        with pytest.raises(ValueError):
            Pair.parse(bad)


def test_quick_and_full_defaults():
    from orchestra.bench import BenchConfig

    quick = BenchConfig(quick=True).resolved()
    assert quick.lengths == [512, 1024] and quick.windows == 1 and quick.pipeline_agents == [2]
    assert quick.pairs == ["root>finetuned", "root>quantized", "root>distilled", "finetuned>root"]
    full = BenchConfig().resolved()
    assert full.lengths == [512, 1024, 2048, 4096, 8192] and full.pipeline_agents == [2, 4, 8]
    assert full.repair_length == 4096 and quick.repair_length == 1024 and 0.15 in full.repair_budgets
    assert {"finetuned>root", "quantized>root", "distilled>root"} <= set(full.pairs or [])
    assert full.task_pairs is None  # tasks: the source into every member the family manifest lists
    assert BenchConfig(pairs=["root>finetuned", "finetuned>root"]).resolved().task_pairs == ["root>finetuned"]
    assert full.task_tokens == 512 and full.task_max_new_tokens == 24 and quick.qa_limit == 12
    assert BenchConfig(sections=["timing", "quality"]).sections == ["quality", "timing"]
    with pytest.raises(ValueError):
        BenchConfig(sections=["nope"])


def test_cli_registers_bench():
    from typer.testing import CliRunner

    from orchestra.cli import app

    result = CliRunner().invoke(app, ["bench", "--help"])
    assert result.exit_code == 0 and "--quick" in result.output and "--sections" in result.output


def test_cli_rejects_an_unknown_section_cleanly(tmp_path):
    from typer.testing import CliRunner

    from orchestra.cli import app

    result = CliRunner().invoke(app, ["bench", "--sections", "bogus", "--out", str(tmp_path), "--home", str(tmp_path)])
    assert result.exit_code == 2
    assert "bogus" in result.output and "Traceback" not in result.output
