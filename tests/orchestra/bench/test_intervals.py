"""Intervals on the bench's shares and ratios: textbook values, pairing, and the edges."""

from __future__ import annotations

import pytest

from orchestra.bench.intervals import paired_ratio_interval, wilson


def test_wilson_interval_matches_the_textbook_value():
    low, high = wilson(97, 100)
    assert low == pytest.approx(0.9154, abs=1e-3) and high == pytest.approx(0.9897, abs=1e-3)
    low, high = wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)


def test_wilson_refuses_more_hits_than_trials():
    with pytest.raises(ValueError, match="hits must lie"):
        wilson(11, 10)


def test_retention_interval_holds_the_estimate_and_narrows_with_more_questions():
    own = [True] * 17 + [False] * 43
    mapped = [True] * 13 + [False] * 4 + [True] + [False] * 42  # 4 lost, 1 gained: retention 14/17
    low, high = paired_ratio_interval(own, mapped)
    assert low < 14 / 17 < 1.0 < high  # a map can gain answers: retention is not capped at 1
    low4, high4 = paired_ratio_interval(own * 4, mapped * 4)
    assert low < low4 < 14 / 17 < high4 < high


def test_pairing_makes_identical_answers_certain():
    # the same answers both ways: every resample reads retention 1, however few the questions
    own = [True, False, True, True, False]
    assert paired_ratio_interval(own, list(own)) == (1.0, 1.0)


def test_pairing_is_narrower_than_treating_the_two_conditions_as_independent():
    # 30 of 40 right on both caches but for one lost question: paired, the ratio is tight
    own = [True] * 30 + [False] * 10
    mapped = [True] * 29 + [False] * 11
    low, high = paired_ratio_interval(own, mapped)
    own_low, own_high = wilson(30, 40)
    assert high - low < (own_high - own_low) / 2


def test_the_interval_is_the_same_on_every_call():
    own = [i % 3 == 0 for i in range(50)]
    mapped = [i % 4 == 0 for i in range(50)]
    assert paired_ratio_interval(own, mapped) == paired_ratio_interval(own, mapped)


def test_no_own_hit_has_no_retention_and_unequal_samples_are_refused():
    assert paired_ratio_interval([False, False], [True, False]) is None
    assert paired_ratio_interval([], []) is None
    with pytest.raises(ValueError, match="differ in length"):
        paired_ratio_interval([True], [True, False])
    with pytest.raises(ValueError, match="level"):
        paired_ratio_interval([True], [True], level=1.5)
