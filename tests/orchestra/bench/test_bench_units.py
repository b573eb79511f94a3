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
    assert quick.pairs == ["root>finetuned", "root>int8", "root>quantized", "root>distilled", "finetuned>root"]
    full = BenchConfig().resolved()
    assert full.lengths == [512, 1024, 2048, 4096, 8192] and full.pipeline_agents == [2, 4, 8]
    assert full.repair_length == 4096 and quick.repair_length == 1024 and 0.15 in full.repair_budgets
    assert {"finetuned>root", "int8>root", "quantized>root", "distilled>root"} <= set(full.pairs or [])
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


def test_repair_table_shows_planned_token_share_and_measured_side_by_side():
    from orchestra.bench.repair import RepairConfig, RepairPoint, RepairSection, repair_markdown

    section = RepairSection(config=RepairConfig(pairs=[], length=4096), document="doc", points=[
        RepairPoint(pair="a>b", label="map", budget=0.0, kl=0.04, top1=0.9, top5=0.99, planned_cost=0.0,
                    measured_cost=0.0, token_share=0.0, map_share=0.009),
        RepairPoint(pair="a>b", label="repair@10%", budget=0.1, kl=0.006, top1=0.97, top5=1.0, planned_cost=0.098,
                    measured_cost=0.105, token_share=0.071, map_share=0.009, tokens=291),
    ])
    md = "\n".join(repair_markdown(section))
    assert ("| pair | policy | KL | top-1 | top-5 | planned (measured) | token share | measured | measured / planned "
            "| map | other | tokens | layer blocks |") in md  # budgets priced by timed passes unless told otherwise
    assert "timed pass costs on this machine" in md
    compute = section.model_copy(update={"config": RepairConfig(pairs=[], length=4096, costs="compute")})
    assert "| planned (compute) |" in "\n".join(repair_markdown(compute))
    assert "| a>b | repair@10% | 0.0060 | 0.970 | 1.000 | 9.8% | 7.1% | 10.5% | 1.07x | 0.9% | 0.0% | 291 | - |" in md
    assert "| a>b | map | 0.0400 | 0.900 | 0.990 | 0.0% | 0.0% | 0.0% | - | 0.9% |" in md
    assert "repair@10%, KL 0.0060, top-1 0.970, planned cost 9.8%, measured 10.5%" in md
