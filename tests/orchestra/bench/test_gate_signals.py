"""Candidate gate readings: how each is scored against what the map did to an answer, and that the tasks
section records them for every mapped answer."""

from __future__ import annotations

import pytest

from orchestra.bench.gate_signals import Judged, score_candidates, start_readings, threshold_for_catch


def test_threshold_catches_at_least_the_target_share_of_harmed_questions():
    assert threshold_for_catch([0.9, 0.1, 0.5, 0.7, 0.3]) == 0.3  # 4 of 5 read >= 0.3
    assert threshold_for_catch([0.2]) == 0.2
    assert threshold_for_catch([]) is None
    assert threshold_for_catch([0.9, 0.1], target=0.5) == 0.9


def test_a_reading_that_separates_harm_catches_it_without_false_alarms_and_a_blind_one_does_not():
    judged = [Judged({"probe_excess_kl": 0.9, "start_kl_source": 0.1}, harmed=True, changed=True),
              Judged({"probe_excess_kl": 0.8, "start_kl_source": 0.5}, harmed=True, changed=True),
              Judged({"probe_excess_kl": 0.1, "start_kl_source": 0.5}, harmed=False, changed=True),
              Judged({"probe_excess_kl": 0.2, "start_kl_source": 0.1}, harmed=False, changed=False),
              Judged({"probe_excess_kl": 0.0, "start_kl_source": 0.3}, harmed=False, changed=False)]
    by = {c.signal: c for c in score_candidates(judged)}
    good, blind = by["probe_excess_kl"], by["start_kl_source"]
    assert (good.harmed, good.changed, good.questions) == (2, 3, 5)
    assert good.threshold == 0.8 and good.catch_rate == 1.0 and good.false_alarm_rate == 0.0
    assert good.changed_catch_rate == pytest.approx(2 / 3) and good.auc == 1.0
    assert blind.threshold == 0.1 and blind.catch_rate == 1.0 and blind.false_alarm_rate == 1.0
    assert blind.auc == pytest.approx(0.5)
    assert "oracle_start_kl_own" not in by  # no question read it


def test_a_threshold_tuned_elsewhere_is_applied_as_given():
    judged = [Judged({"probe_excess_kl": 0.9}, True, True), Judged({"probe_excess_kl": 0.4}, True, True),
              Judged({"probe_excess_kl": 0.5}, False, False)]
    (c,) = score_candidates(judged, {"probe_excess_kl": 0.45})
    assert c.threshold == 0.45 and c.catch_rate == 0.5 and c.false_alarm_rate == 1.0


def test_answer_start_readings_compare_the_first_token_distributions():
    import torch

    same = torch.tensor([2.0, 0.0, -1.0])
    r = start_readings(same, same.clone(), same.clone())
    assert r["start_kl_source"] == pytest.approx(0.0, abs=1e-6) and r["start_top1_miss_source"] == 0.0
    assert r["oracle_start_kl_own"] == pytest.approx(0.0, abs=1e-6)
    flipped = start_readings(torch.tensor([0.0, 2.0, -1.0]), same, None)
    assert flipped["start_top1_miss_source"] == 1.0 and flipped["start_kl_source"] > 0.5
    assert "oracle_start_kl_own" not in flipped


def test_the_probe_reports_top1_agreement_and_entropy_shift_against_the_source():
    import torch

    from orchestra.familycache.gates import ProbeCheck, ProbeGate

    source = torch.tensor([[4.0, 0.0, 0.0], [0.0, 4.0, 0.0], [0.0, 0.0, 4.0]])
    check = ProbeCheck((0, 1, 2), source, reference_nll=0.1, reference_source_kl=0.0, gate=ProbeGate())
    exact = check.metrics(source.clone())
    assert exact["probe_source_top1"] == 1.0 and exact["probe_entropy_shift"] == pytest.approx(0.0, abs=1e-6)
    blurred = check.metrics(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert blurred["probe_source_top1"] == pytest.approx(2 / 3) and blurred["probe_entropy_shift"] > 0.3
    decision = check.decide(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert decision.metrics["probe_source_top1"] == pytest.approx(2 / 3)  # reported, not thresholded


def test_answer_readings_name_the_nearest_tie_and_the_answer_loss():
    import torch

    from orchestra.bench.gate_signals import answer_readings

    # token 0 wins clearly, then token 1 wins by a hair over token 2
    logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 1.0, 0.9]])
    r = answer_readings(logits, [0, 1])
    logp = torch.log_softmax(logits, dim=-1)
    assert r["answer_tie"] == pytest.approx(-0.1, abs=1e-5)
    assert r["answer_nll"] == pytest.approx(-float(logp[0, 0] + logp[1, 1]) / 2)
    assert answer_readings(logits[:0], []) == {}


def test_answer_logits_are_the_distributions_the_greedy_answer_was_drawn_from(tiny_family):
    """Teacher-forcing the answer reproduces the step-by-step decode's distributions, and leaves the cache alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from agents.kv import copy_cache, forward_tokens
    from mappings.cache_io import cache_layers, forward_with_cache
    from orchestra.bench.gate_signals import answer_logits

    model = AutoModelForCausalLM.from_pretrained(tiny_family.child).eval()
    prefix, suffix = list(range(5, 17)), [3, 9, 4]
    _, cache, _ = forward_with_cache(model, torch.tensor([prefix]))
    before = [k.clone() for k, _ in cache_layers(cache)]
    step, answer, rows = copy_cache(cache, model), [], []
    logits = forward_tokens(model, suffix, step, len(prefix))
    for i in range(4):
        rows.append(logits)
        answer.append(int(logits.argmax()))
        logits = forward_tokens(model, [answer[-1]], step, len(prefix) + len(suffix) + i)
    forced = answer_logits(model, cache, len(prefix), suffix, answer)
    assert forced.shape == (4, rows[0].shape[-1])
    torch.testing.assert_close(forced, torch.stack(rows).cpu(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(answer_logits(model, cache, len(prefix), suffix)[0], rows[0].cpu(), atol=1e-4, rtol=1e-4)
    after = [k for k, _ in cache_layers(cache)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)) and after[0].shape[-2] == len(prefix)
