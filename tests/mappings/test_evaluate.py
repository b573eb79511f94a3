from __future__ import annotations

import dataclasses
import json

import pytest

from mappings.calibrate import calibrate
from mappings.errors import DocumentTooLongError, DocumentTooShortError, StaleMappingError
from mappings.evaluate import BASELINES, EvaluationSettings, evaluate, write_report
from tests.mappings.conftest import TOKENS, WINDOW, load_tokenizer

PREFIX, SUFFIX, TAIL, GREEDY = 192, 32, 32, 16


@pytest.fixture(scope="session")
def tiny_report(tiny_mapping, document):
    settings = EvaluationSettings(prefix_tokens=PREFIX, suffix_tokens=SUFFIX, tail_tokens=TAIL, greedy_tokens=GREEDY,
                                  repair_costs="compute")
    return evaluate(tiny_mapping.path, document, settings, document_name="gpl-3.txt")


def test_settings_keep_the_former_defaults_and_are_frozen_and_validated():
    from mappings.repair import RepairPolicy

    s = EvaluationSettings()
    assert (s.prefix_tokens, s.suffix_tokens, s.windows, s.tail_tokens, s.sink_tokens, s.greedy_tokens, s.baselines,
            s.layer_curves, s.repairs, s.repair_costs, s.timing_repeats, s.device) == (
        1024, 32, 1, 64, 4, 64, BASELINES, True, (), "measured", 2, "cpu")
    policy = RepairPolicy(budget=0.5)
    given = EvaluationSettings(baselines=["identity"], repairs=[policy])
    assert given.baselines == ("identity",) and given.repairs == (policy,)  # frozen all the way down
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.windows = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="repair_costs"):
        EvaluationSettings(repair_costs="guessed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timing_repeats"):
        dataclasses.replace(s, timing_repeats=0)


def test_an_unknown_keyword_is_a_type_error_naming_the_settings():
    # refused before anything is loaded: neither the mapping nor the document exist
    with pytest.raises(TypeError, match=r"evaluate\(\) got an unexpected keyword argument 'prefix'.*prefix_tokens, "):
        evaluate("no/such/mapping", "text", prefix=8)
    with pytest.raises(TypeError, match="EvaluationSettings, not dict"):
        evaluate("no/such/mapping", "text", {"prefix_tokens": 8})  # type: ignore[arg-type]


def test_report_has_every_method_and_field(tiny_report, tiny_mapping):
    names = [r.method for r in tiny_report.methods]
    assert names == ["reprefill", "identity", "ridge", "anchored", "perhead_rope", "anchored_kl", "anchored_kl+sinks4",
                     f"anchored_kl+tail{TAIL}", f"identity+tail{TAIL}"]
    truth = tiny_report.row("reprefill")
    assert truth.kl == pytest.approx(0.0, abs=1e-9) and truth.top1 == 1.0 and truth.greedy_agreement == GREEDY
    assert truth.prefill_seconds > 0 and truth.map_seconds == 0.0
    for r in tiny_report.methods:
        assert r.kl >= -1e-9 and 0 <= r.top1 <= 1 and 0 <= r.top5 <= 1
        assert r.top5 >= r.top1
        assert 0 <= r.greedy_agreement <= GREEDY
    assert tiny_report.row(f"anchored_kl+tail{TAIL}").prefill_seconds > 0
    assert tiny_report.source["fingerprint"]["combined"] == tiny_mapping.mapping.manifest.source.fingerprint["combined"]
    assert len(tiny_report.single_layer) == len(tiny_report.accumulation) == len(tiny_mapping.mapping.kv_map.layers)
    assert tiny_report.skipped == {}


def test_mapped_beats_source_reuse_on_an_unseen_document(tiny_report):
    """Measured on the three tiny families: anchored_kl KL is 3-50x below source-KV reuse on gpl-3.txt."""
    own, reuse = tiny_report.row("anchored_kl"), tiny_report.row("identity")
    assert own.kl <= reuse.kl * 1.05
    assert tiny_report.row(f"anchored_kl+tail{TAIL}").kl <= reuse.kl * 1.05


def test_sinks_row_is_the_map_with_its_first_positions_exact(tiny_report, tiny_mapping, document, corpus):
    own, sinks = tiny_report.row("anchored_kl"), tiny_report.row("anchored_kl+sinks4")
    assert sinks.kl != own.kl  # the same map, four positions changed: the scores move
    assert sinks.prefill_seconds > 0 and 0 < sinks.cost_fraction < 0.05 and sinks.token_share == pytest.approx(4 / PREFIX)
    # a map fitted without its sinks is only served with them: asking for none still scores the served row
    forced = evaluate(tiny_mapping.path, document, prefix_tokens=PREFIX, suffix_tokens=SUFFIX, tail_tokens=0,
                      sink_tokens=0, greedy_tokens=0, layer_curves=False, baselines=(), repair_costs="compute")
    assert [r.method for r in forced.methods] == ["reprefill", "anchored_kl", "anchored_kl+sinks4"]
    fam = tiny_mapping.family
    plain = calibrate(fam.parent, fam.child, corpus, method="anchored", tokens=TOKENS, window=WINDOW, progress=False)
    assert plain.manifest.method.exact_sinks == 0
    bare = evaluate(plain, document, source=fam.parent, target=fam.child, prefix_tokens=PREFIX, suffix_tokens=SUFFIX,
                    tail_tokens=0, sink_tokens=0, greedy_tokens=0, layer_curves=False, baselines=(),
                    repair_costs="compute")
    assert not any("+sinks" in r.method for r in bare.methods)


def test_accumulation_ends_at_the_full_mapping(tiny_report):
    """The curves are of the served cache (its sinks exact): every layer mapped is the +sinks row."""
    last = tiny_report.accumulation[-1]
    assert last.kl == pytest.approx(tiny_report.row("anchored_kl+sinks4").kl, rel=1e-4, abs=1e-7)
    assert tiny_report.accumulation[0].kl == pytest.approx(tiny_report.single_layer[0].kl, rel=1e-6, abs=1e-9)


def test_json_and_png_are_written(tiny_report, tmp_path):
    report = write_report(tiny_report, tmp_path / "eval.json")
    data = json.loads((tmp_path / "eval.json").read_text())
    for row in data["methods"]:
        assert {"method", "kl", "top1", "top5", "nll_delta", "map_seconds", "prefill_seconds"} <= set(row)
    assert set(data["source"]["fingerprint"]) == {"config", "weights", "tokenizer", "combined"}
    assert report.plots and (tmp_path / "eval_layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data["single_layer"]) == len(data["accumulation"]) > 0
    from mappings.evaluate import EvaluationReport

    assert EvaluationReport.model_validate_json((tmp_path / "eval.json").read_text()) == report


def test_identity_pair_has_near_zero_kl(llama_family, corpus, document):
    mapping = calibrate(llama_family.parent, llama_family.parent, corpus, tokens=TOKENS, window=WINDOW, progress=False)
    report = evaluate(mapping, document, source=llama_family.parent, target=llama_family.parent,
                      prefix_tokens=PREFIX, suffix_tokens=SUFFIX, tail_tokens=0, greedy_tokens=GREEDY,
                      baselines=("identity",), layer_curves=False)
    own = report.row("anchored_kl")
    assert own.kl < 1e-6 and own.top1 == 1.0 and own.greedy_agreement == GREEDY
    assert report.row("identity").kl < 1e-6
    assert [r.method for r in report.methods] == ["reprefill", "identity", "anchored_kl", "anchored_kl+sinks4"]
    assert report.row("anchored_kl+sinks4").kl < 1e-6


def test_shape_mismatched_pair_skips_what_cannot_run(llama_family, mha_variant, corpus, document):
    mapping = calibrate(llama_family.parent, mha_variant, corpus, tokens=TOKENS, window=WINDOW, progress=False)
    report = evaluate(mapping, document, source=llama_family.parent, target=mha_variant, prefix_tokens=PREFIX,
                      suffix_tokens=SUFFIX, tail_tokens=TAIL, greedy_tokens=4)
    assert {"identity", "anchored", "perhead_rope"} <= set(report.skipped)
    assert [r.method for r in report.methods] == ["reprefill", "ridge", "ridge_kl", "ridge_kl+sinks4", f"ridge_kl+tail{TAIL}"]
    assert all(r.kl == r.kl and r.kl < 10 for r in report.methods)  # finite


def test_document_limits(tiny_mapping, document):
    with pytest.raises(DocumentTooLongError, match="512 positions"):
        evaluate(tiny_mapping.path, document, prefix_tokens=600, suffix_tokens=8, greedy_tokens=0)
    with pytest.raises(DocumentTooLongError, match="greedy"):
        evaluate(tiny_mapping.path, document, prefix_tokens=480, suffix_tokens=16, greedy_tokens=64)
    with pytest.raises(DocumentTooShortError, match="has 3 tokens"):
        evaluate(tiny_mapping.path, [5, 6, 7], prefix_tokens=8, suffix_tokens=8)


def test_evaluating_with_other_models_is_refused(tiny_mapping, document, llama_family, qwen2_family):
    fam = tiny_mapping.family
    other = qwen2_family if fam.arch != "qwen2" else llama_family
    with pytest.raises(StaleMappingError):
        evaluate(tiny_mapping.path, document, target=other.child, prefix_tokens=64, suffix_tokens=8)


def test_several_windows_average_single_window_results(tiny_mapping, document):
    tok = load_tokenizer(tiny_mapping.family.child)
    ids = tok(document, add_special_tokens=False)["input_ids"]
    kwargs = dict(prefix_tokens=64, suffix_tokens=8, tail_tokens=8, greedy_tokens=4, baselines=("identity",))
    settings = EvaluationSettings(**kwargs)
    both = evaluate(tiny_mapping.path, ids, settings, windows=2)  # a keyword over the settings
    first = evaluate(tiny_mapping.path, ids[:73], settings)
    second = evaluate(tiny_mapping.path, ids[72:], **kwargs)  # the keywords alone
    assert both.windows == 2
    for name in ("identity", "anchored_kl", "anchored_kl+tail8"):
        assert both.row(name).kl == pytest.approx((first.row(name).kl + second.row(name).kl) / 2, rel=1e-5)
        assert both.row(name).top1 == pytest.approx((first.row(name).top1 + second.row(name).top1) / 2)
    assert both.single_layer[0].kl == pytest.approx((first.single_layer[0].kl + second.single_layer[0].kl) / 2, rel=1e-5)
    with pytest.raises(DocumentTooShortError, match="3 window"):
        evaluate(tiny_mapping.path, ids[:150], windows=3, **kwargs)


def test_repair_rows_trace_the_quality_cost_curve(tiny_mapping, document):
    """More repair budget, lower KL; a full budget reaches the re-prefill; costs are what the plans spent: the
    planned cost in compute (attention counted) within the budget, the token share what was recomputed."""
    from mappings.repair import RepairPolicy

    budgets = (0.1, 0.5, 1.0)
    report = evaluate(tiny_mapping.path, document, prefix_tokens=PREFIX, suffix_tokens=SUFFIX, tail_tokens=TAIL,
                      greedy_tokens=0, layer_curves=False, baselines=("identity",),
                      repairs=[RepairPolicy(budget=b) for b in budgets], repair_costs="compute")
    own = report.row("anchored_kl")
    rows = [report.row(f"anchored_kl+repair@{b * 100:g}%") for b in budgets]
    assert own.cost_fraction == own.token_share == 0.0
    assert report.row("reprefill").cost_fraction == report.row("reprefill").token_share == 1.0
    for b, r in zip(budgets, rows, strict=True):
        assert b - 2.0 / PREFIX < r.cost_fraction <= b + 1e-9  # one more tail token would pass the budget
        assert r.cost_fraction == r.repair["cost"] and r.token_share == r.repair["token_share"]
        # the repair starts from the served cache: its 4 exact sinks are paid in the plan, never recomputed
        assert r.repair["exact"] == 4 and r.prefill_seconds > 0
        assert r.token_share == pytest.approx((r.repair["tokens"] + 4) / PREFIX)
        assert r.repair["tokens"] + 4 <= round(b * PREFIX)
    assert rows[2].repair["tokens"] == PREFIX - 4 and rows[2].cost_fraction == pytest.approx(1.0)
    tail_row = report.row(f"anchored_kl+tail{TAIL}")  # the served cache's sinks and the tail
    assert tail_row.token_share == pytest.approx((TAIL + 4) / PREFIX) and tail_row.cost_fraction > tail_row.token_share
    # half the tokens recomputed (the trailing half): clearly below the pure map on every tiny family
    assert rows[1].kl < own.kl * 0.8
    assert rows[2].kl == pytest.approx(0.0, abs=1e-6) and rows[2].top1 == 1.0


def test_repair_rows_share_one_map_and_report_measured_cost(tiny_mapping, document, monkeypatch):
    """Issue 16: the window is mapped once for the own row and every repair row; each repair row reports its
    measured cost (target repair seconds / own prefill seconds) next to the planned one."""
    from mappings.apply import LinearKVMap
    from mappings.repair import RepairPolicy

    calls = []
    original = LinearKVMap.apply

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LinearKVMap, "apply", counted)
    report = evaluate(tiny_mapping.path, document, prefix_tokens=PREFIX, suffix_tokens=SUFFIX, tail_tokens=TAIL,
                      greedy_tokens=0, layer_curves=False, baselines=("identity",),
                      repairs=[RepairPolicy(budget=b) for b in (0.1, 0.25, 0.5)], repair_costs="compute")
    assert len(calls) == 3  # identity, the own map and the identity's tail row: the own tail and repairs reuse it
    own = report.row("anchored_kl")
    assert report.row("reprefill").measured_cost == 1.0 and own.measured_cost == 0.0
    assert report.row(f"anchored_kl+tail{TAIL}").measured_cost > 0
    for b in (0.1, 0.25, 0.5):
        r = report.row(f"anchored_kl+repair@{b * 100:g}%")
        assert r.measured_cost is not None and r.measured_cost > 0 and r.map_seconds == own.map_seconds
        assert r.prefill_seconds >= r.measured_cost * report.reference_prefill_seconds * 0.999


def test_measured_costs_price_the_plans_and_are_kept_beside_the_mapping(tiny_mapping, document):
    """With measured pass costs (the default) every planned cost is the target's predicted seconds over its
    predicted prefill: the repair stays within its budget in that measure, and the timings are stored once."""
    from mappings.passcost import PassCosts
    from mappings.repair import RepairPolicy

    report = evaluate(tiny_mapping.path, document, prefix_tokens=PREFIX, suffix_tokens=SUFFIX, tail_tokens=TAIL,
                      greedy_tokens=0, layer_curves=False, baselines=(), repairs=[RepairPolicy(budget=1.0)])
    arch = report.pass_costs["key"]["architecture"]
    stored = list((tiny_mapping.path.parent / "pass-costs").glob(f"{arch[:16]}-*.json"))
    assert len(stored) == 1  # one file per target architecture (the tiny archs share the folder)
    costs = PassCosts.load(stored[0])
    assert costs.key["architecture"] == arch and costs.measured_on in ("", report.target["fingerprint"]["combined"])
    assert report.pass_costs["per_pass"] == costs.per_pass
    tail_row = report.row(f"anchored_kl+tail{TAIL}")
    assert tail_row.cost_fraction == pytest.approx(costs.share(PREFIX, [*range(4), *range(PREFIX - TAIL, PREFIX)]))
    full = report.row("anchored_kl+repair@100%")
    assert full.repair["costs"] == "measured" and full.repair["tokens"] == PREFIX - 4 and full.repair["exact"] == 4
    assert full.cost_fraction == pytest.approx(1.0)  # a full recompute is one prefill in any measure


def test_timing_repeats_change_timings_only(tiny_mapping, document):
    """Repairs timed as the fastest of several runs score exactly what one run scores; 0 runs is refused."""
    from mappings.repair import RepairPolicy

    kw = dict(prefix_tokens=PREFIX, suffix_tokens=SUFFIX, tail_tokens=TAIL, greedy_tokens=0, layer_curves=False,
              baselines=(), repairs=[RepairPolicy(budget=0.5)], repair_costs="compute")
    once = evaluate(tiny_mapping.path, document, timing_repeats=1, **kw)
    thrice = evaluate(tiny_mapping.path, document, EvaluationSettings(timing_repeats=3, **kw))
    for a, b in zip(once.methods, thrice.methods, strict=True):
        assert (a.method, a.kl, a.top1, a.cost_fraction) == (b.method, b.kl, b.top1, b.cost_fraction)
    row = thrice.row("anchored_kl+repair@50%")
    assert row.measured_cost is not None and row.measured_cost > 0
    with pytest.raises(ValueError, match="timing_repeats"):
        evaluate(tiny_mapping.path, document, timing_repeats=0, **kw)
