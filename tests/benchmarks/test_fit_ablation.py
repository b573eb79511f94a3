"""benchmarks/fit_ablation.py: the variants are the method's defaults one change at a time; the table reads them."""

from __future__ import annotations

import pytest

from tests.benchmarks.conftest import load_script


@pytest.fixture(scope="module")
def fa():
    return load_script("fit_ablation")


def test_variants_walk_from_the_old_method_to_the_default(fa):
    from mappings.methods import METHODS

    variants = [change for change, calibration in fa.VARIANT_SETS["served"].values() if not calibration]
    assert len(variants) == len(fa.VARIANT_SETS["served"])  # the served set changes the method, never the data
    assert variants[0] == {"exact_sinks": 0, "value_weights": "uniform"}  # every row alike: the method before
    for name in ("anchored_kl", "ridge_kl"):
        spec = METHODS[name]
        assert variants[-1] == {"exact_sinks": spec.exact_sinks, "value_weights": spec.value_weights}
    for a, b in zip(variants, variants[1:], strict=False):  # one change at a time
        assert sum(a[k] != b[k] for k in a) == 1


def test_the_length_set_changes_one_thing_from_the_shipped_fit(fa):
    length = fa.VARIANT_SETS["length"]
    assert list(length.values())[0] == ({}, {})  # the shipped method on the shipped 512-token windows
    for label, (change, calibration) in list(length.items())[1:]:
        assert change or calibration, label
        assert set(calibration) <= {"window"} and set(change) <= {"granularity", "rank", "rank_fraction"}


def test_the_selection_set_only_judges_on_more_heldout_tokens(fa):
    from mappings.calibrate import CalibrationSettings
    from mappings.methods import METHODS

    selection = fa.VARIANT_SETS["selection"]
    assert list(selection.values())[0] == ({}, {})
    shipped_windows, shipped_tokens = CalibrationSettings().heldout_fraction, METHODS["anchored_kl"].kl_suffix_tokens
    for label, (change, calibration) in list(selection.items())[1:]:
        assert set(calibration) <= {"heldout_fraction"} and set(change) <= {"kl_suffix_tokens"}, label
        # every variant judges on more held-out tokens than the shipped fit, and fits the same rows
        assert calibration.get("heldout_fraction", shipped_windows) * change.get("kl_suffix_tokens", shipped_tokens) \
            > shipped_windows * shipped_tokens, label


def test_the_tail_set_changes_only_how_layers_are_chosen(fa):
    tail = fa.VARIANT_SETS["tail"]
    assert list(tail.values())[0] == ({}, {})
    changes = [change for change, calibration in list(tail.values())[1:] if not calibration]
    assert changes == [{"judged_tail": fa.TAIL}, {"selection": "none"}]
    from orchestra.familycache import CachePolicy

    assert fa.TAIL == CachePolicy().tail_tokens  # the tail a FamilyCache recomputes on every mapped cache


def test_the_data_set_changes_only_the_fitting_text_and_never_fits_the_scored_one(fa):
    from orchestra.documents.texts import CALIBRATION_TEXTS, HELDOUT_TEXT, data_text

    data = fa.VARIANT_SETS["data"]
    assert list(data.values())[0] == ({}, {})
    for label, (change, calibration) in list(data.items())[1:]:
        assert not change, label  # the shipped method: only the text it is fitted on changes
        assert set(calibration) <= {"corpus", "tokens", "window", "max_heldout_windows"}, label
        # the same two windows judge each layer as in the shipped calibration (16 fitting windows x 0.125)
        assert calibration["max_heldout_windows"] == 2, label
    # the shipped texts stay, the held-out judge stays last, and GPL-3, which every row is scored on, is never fitted
    assert set(CALIBRATION_TEXTS) <= set(fa.MORE_TEXTS) and fa.MORE_TEXTS[-1] == CALIBRATION_TEXTS[-1]
    assert HELDOUT_TEXT not in fa.MORE_TEXTS
    assert all(data_text(name).strip() for name in fa.MORE_TEXTS)


def test_table_and_summary_read_the_rows(fa):
    def row(label, test, dev):
        return {"variant": label, "heldout_kl": 0.01, "calibration_seconds": 60.0,
                "test": {"kl": test, "top1": 0.94, "pure_kl": test * 1.4, "pure_top1": 0.92},
                "dev": {"kl": dev, "top1": 0.97, "pure_kl": dev * 1.4, "pure_top1": 0.95}}

    results = [{"member": "finetuned", "name": "m", "method": "anchored_kl",
                "rows": [row("before", 0.0160, 0.0200), row("judged with sinks", 0.0140, 0.0125),
                         row("+ attention values", 0.0120, 0.0116)]}]
    md = fa.markdown(results, "python benchmarks/fit_ablation.py", 4096)
    assert "| finetuned (anchored_kl) | before | 0.0160 | 0.940 | 0.0200 | 0.970 | - | - | 0.0224 |" in md
    assert "- finetuned: test 0.0160 -> 0.0120 (-25%); dev 0.0200 -> 0.0116 (-42%)" in md
    assert "4,096 tokens" in md
    tailed = row("judged with the 32-token tail recomputed", 0.0110, 0.0100)
    tailed["test"].update(tail_kl=0.0081, tail_top1=0.961)
    md = fa.markdown([{**results[0], "rows": [tailed]}], "python benchmarks/fit_ablation.py", 8192, "tail")
    assert "| 0.0100 | 0.970 | 0.0081 / 0.961 | - | 0.0154 |" in md
