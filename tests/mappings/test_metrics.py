from __future__ import annotations

import math

import pytest
import torch

from mappings.metrics import (
    attention_output,
    fit_quality,
    kl_divergence,
    mean_kl,
    next_token_agreement,
    tail_nll,
)


def test_kl_is_zero_for_equal_logits_and_matches_definition():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    assert float(kl_divergence(a, a).abs().max()) < 1e-12
    p, q = a.double().softmax(-1), b.double().softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1)
    torch.testing.assert_close(kl_divergence(a, b), expected)
    assert float(kl_divergence(a, b).min()) >= 0


def test_agreement_counts():
    true = torch.tensor([[[5.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 5.0, 1.0, 0.0, 0.0, 0.0]]])
    other = torch.tensor([[[5.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 5.0, 0.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, -100]])
    out = next_token_agreement(true, other, labels)
    assert out["top1"] == 0.5 and out["top5"] == 1.0
    assert out["nll_delta"] == pytest.approx(0.0, abs=1e-12)  # the only labelled position agrees exactly
    worse = next_token_agreement(true, torch.zeros_like(true), torch.tensor([[0, 1]]))
    assert worse["nll_delta"] > 0
    assert math.isnan(next_token_agreement(true, other, torch.full((1, 2), -100))["nll_delta"])


def test_fit_quality():
    x = torch.randn(50, 8)
    perfect = fit_quality(x, x)
    assert perfect["cosine"] == pytest.approx(1.0) and perfect["rel_mse"] == 0.0 and perfect["r2"] == 1.0
    assert fit_quality(torch.zeros_like(x), x)["rel_mse"] == pytest.approx(1.0)


def test_attention_output_handles_gqa_and_causality():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    out = attention_output(q, k, v, 8**-0.5)
    assert out.shape == (1, 6, 32)
    # the first position attends only to itself: its output is its own value vector (per group)
    torch.testing.assert_close(out[0, 0, :8], v[0, 0, 0])
    torch.testing.assert_close(out[0, 0, 16:24], v[0, 1, 0])


def test_attention_received_is_causal_softmax_weight_per_kv_head():
    from mappings.metrics import attention_received

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    positions = torch.tensor([5, 8, 9])
    got = attention_received(q, k, positions, 0.3)
    assert got.shape == (2, 2, 10)
    want = torch.zeros(2, 2, 10)
    for b in range(2):
        for h in range(4):
            for j, pos in enumerate(positions.tolist()):
                weights = torch.softmax(q[b, h, j] @ k[b, h // 2, : pos + 1].T * 0.3, -1)
                want[b, h // 2, : pos + 1] += weights / (2 * 3)  # two query heads per KV head, three queries
    torch.testing.assert_close(got, want)
    assert float(got[..., 6:].sum()) > 0 and torch.all(got[..., 9] > 0)  # later keys: only the queries after them
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 2))


def test_mean_kl_and_tail_nll_match_their_definitions():
    g = torch.Generator().manual_seed(1)
    p, q = torch.randn(6, 13, generator=g), torch.randn(6, 13, generator=g)
    assert mean_kl(p, p) == pytest.approx(0.0, abs=1e-6)
    assert mean_kl(p, q) == pytest.approx(float(kl_divergence(p, q).mean()), rel=1e-5)
    assert mean_kl(p[None], q[None]) == pytest.approx(mean_kl(p, q), rel=1e-6)  # every leading index is a position
    ids = torch.randint(0, 13, (6,), generator=g)
    expected = -float(torch.log_softmax(p.double(), -1)[torch.arange(5), ids[1:]].mean())
    assert tail_nll(p, ids) == pytest.approx(expected, rel=1e-5)
    assert tail_nll(p[None], ids[None]) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        tail_nll(p[:1], ids[:1])
