from __future__ import annotations

import pytest
from pydantic import ValidationError

from orchestra.familycache.gates import (
    CircuitBreaker,
    GatePolicy,
    OfflineGate,
    ProbeGate,
    ShadowGate,
    decide_offline,
    decide_probe,
)


def test_offline_gate_thresholds_and_reasons():
    policy = OfflineGate(max_kl=0.05, min_top1=0.9)
    assert decide_offline(policy, 0.01, 0.95).passed
    bad_kl = decide_offline(policy, 0.2, 0.95)
    assert not bad_kl.passed and "KL 0.2000 > 0.05" in bad_kl.reason
    bad_top1 = decide_offline(policy, 0.01, 0.5)
    assert not bad_top1.passed and "top-1" in bad_top1.reason
    assert not decide_offline(policy, None, None).passed
    assert decide_offline(policy, 0.01).passed  # top-1 is optional in manifests


def test_probe_gate_uses_excess_over_reference():
    policy = ProbeGate(tokens=16, max_excess_nll=0.2)
    ok = decide_probe(policy, probe_nll=2.1, reference_nll=2.0)
    assert ok.passed and ok.metrics["excess_nll"] == pytest.approx(0.1)
    bad = decide_probe(policy, probe_nll=3.0, reference_nll=2.0)
    assert not bad.passed and "excess 1.000" in bad.reason
    assert not decide_probe(policy, float("nan"), 2.0).passed


def test_policy_rejects_typos():
    with pytest.raises(ValidationError, match="max_kll"):
        GatePolicy.model_validate({"offline": {"max_kll": 0.1}})


def test_breaker_opens_after_failures_and_closes_after_cooldown():
    now = [0.0]
    breaker = CircuitBreaker(clock=lambda: now[0])
    policy = ShadowGate(probability=1.0, window=5, trip_after=2, cooldown_s=10)
    pair = ("root", "tuned")
    assert not breaker.record(pair, False, policy)
    assert not breaker.is_open(pair)
    assert breaker.record(pair, False, policy)
    assert breaker.is_open(pair) and not breaker.is_open(("root", "other"))
    now[0] = 9.9
    assert breaker.is_open(pair)
    now[0] = 10.0
    assert not breaker.is_open(pair)


def test_shadow_sampling_rate_is_seeded():
    breaker = CircuitBreaker()
    policy = ShadowGate(probability=0.3, seed=7)
    draws = [breaker.should_shadow(policy) for _ in range(1000)]
    assert 200 < sum(draws) < 400
    assert not CircuitBreaker().should_shadow(ShadowGate(probability=0.0))
