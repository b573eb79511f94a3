from __future__ import annotations

import pytest
import torch

from mappings.fit import Block, RegressionStats, fit_linear, head_blocks, identity_prior, solve_regularized


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def _data(gen, n=3000, p=12, q=8):
    x = torch.randn(n, p, generator=gen, dtype=torch.float64)
    w = torch.randn(p, q, generator=gen, dtype=torch.float64)
    b = torch.randn(q, generator=gen, dtype=torch.float64)
    return x, w, b


def test_plain_least_squares_recovers_the_map(gen):
    x, w, _ = _data(gen)
    fw, fb = fit_linear(RegressionStats.from_data(x, x @ w), alpha=0.0)
    assert fb is None
    torch.testing.assert_close(fw.double(), w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", ["free", "regularized"])
def test_bias_is_recovered(gen, bias):
    x, w, b = _data(gen)
    x = x + 3.0  # non-centred inputs make bias and weights interact
    fw, fb = fit_linear(RegressionStats.from_data(x, x @ w + b), alpha=0.0 if bias == "free" else 1e-12, bias=bias)
    torch.testing.assert_close(fw.double(), w, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fb.double(), b, atol=1e-3, rtol=1e-4)


def test_regularized_bias_is_shrunk_toward_zero(gen):
    x, w, b = _data(gen, q=12)
    stats = RegressionStats.from_data(x, x @ w + b)
    _, free = fit_linear(stats, alpha=10.0, prior=identity_prior(12, 12), bias="free")
    _, shrunk = fit_linear(stats, alpha=10.0, prior=identity_prior(12, 12), bias="regularized")
    assert shrunk.norm() < 0.5 * free.norm()


def test_anchored_ridge_matches_closed_form_and_limits(gen):
    x, _, _ = _data(gen, p=8, q=8)
    y = x @ (torch.eye(8, dtype=torch.float64) + 0.3 * torch.randn(8, 8, generator=gen, dtype=torch.float64))
    stats = RegressionStats.from_data(x, y)
    alpha = 0.5
    lam = alpha * float((x.T @ x).trace()) / 8
    expected = torch.linalg.solve(x.T @ x + lam * torch.eye(8, dtype=torch.float64), x.T @ y + lam * torch.eye(8, dtype=torch.float64))
    fw, _ = fit_linear(stats, alpha=alpha, prior=identity_prior(8, 8))
    torch.testing.assert_close(fw.double(), expected, atol=1e-5, rtol=1e-5)
    huge, _ = fit_linear(stats, alpha=1e9, prior=identity_prior(8, 8))
    torch.testing.assert_close(huge, torch.eye(8), atol=1e-6, rtol=0)
    # plain ridge with huge alpha goes to zero instead
    zero, _ = fit_linear(stats, alpha=1e9)
    assert zero.abs().max() < 1e-6


def test_anchored_exact_on_identity_data(gen):
    x, _, _ = _data(gen, p=8, q=8)
    fw, fb = fit_linear(RegressionStats.from_data(x, x), alpha=3.0, prior=identity_prior(8, 8), bias="regularized")
    torch.testing.assert_close(fw, torch.eye(8), atol=1e-6, rtol=0)
    assert fb.abs().max() < 1e-6


def test_per_head_blocks_recover_block_diagonal_map(gen):
    x, _, _ = _data(gen, p=8, q=12)
    w = torch.zeros(8, 12, dtype=torch.float64)
    w[:4, :6] = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    w[4:, 6:] = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    blocks = head_blocks(1, 2, 4, 2, 6)  # head size 4 -> 6
    assert blocks[1] == Block((4, 5, 6, 7), tuple(range(6, 12)))
    fw, _ = fit_linear(RegressionStats.from_data(x, x @ w), alpha=0.0, blocks=blocks)
    torch.testing.assert_close(fw.double(), w, atol=1e-5, rtol=1e-5)
    # a dense map cannot be represented per head: off-block entries stay exactly zero
    dense, _ = fit_linear(RegressionStats.from_data(x, x @ torch.randn(8, 12, dtype=torch.float64)), alpha=0.0,
                          blocks=blocks)
    assert float(dense[:4, 6:].abs().max()) == 0.0


def test_head_blocks_with_several_sources():
    blocks = head_blocks(2, 2, 3, 2, 3)
    assert blocks[0].inputs == (0, 1, 2, 6, 7, 8)
    assert blocks[1].inputs == (3, 4, 5, 9, 10, 11)
    with pytest.raises(ValueError, match="equal KV head counts"):
        head_blocks(1, 2, 4, 4, 4)


def test_low_rank_recovers_a_low_rank_map(gen):
    x, _, _ = _data(gen, p=10, q=10)
    low = torch.randn(10, 2, generator=gen, dtype=torch.float64) @ torch.randn(2, 10, generator=gen, dtype=torch.float64)
    fw, _ = fit_linear(RegressionStats.from_data(x, x @ low), alpha=0.0, rank=2)
    torch.testing.assert_close(fw.double(), low, atol=1e-5, rtol=1e-5)
    assert int(torch.linalg.matrix_rank(fw.double(), atol=1e-5)) == 2
    # anchored: identity plus a rank-1 correction
    target = torch.eye(10, dtype=torch.float64) + low[:, :1] @ low[:1, :]
    fw, _ = fit_linear(RegressionStats.from_data(x, x @ target), alpha=0.0, prior=identity_prior(10, 10), rank=1)
    torch.testing.assert_close(fw.double(), target, atol=1e-4, rtol=1e-4)
    # a full-rank truth fitted at rank 1 cannot be exact
    full, _ = fit_linear(RegressionStats.from_data(x, x @ torch.randn(10, 10, dtype=torch.float64)), alpha=0.0, rank=1)
    assert int(torch.linalg.matrix_rank(full.double(), atol=1e-4)) == 1


def test_streaming_equals_one_shot(gen):
    x, w, b = _data(gen)
    y = x @ w + b
    streamed = RegressionStats.zeros(12, 8)
    for chunk in range(0, 3000, 700):
        streamed.update(x[chunk : chunk + 700].float(), y[chunk : chunk + 700].float())
    whole = RegressionStats.from_data(x.float(), y.float())
    assert streamed.n == whole.n == 3000
    for name in ("sum_x", "sum_y", "xtx", "xty", "yty"):
        torch.testing.assert_close(getattr(streamed, name), getattr(whole, name), atol=1e-2, rtol=1e-5)
    exact = RegressionStats.zeros(12, 8)
    for chunk in range(0, 3000, 700):
        exact.update(x[chunk : chunk + 700], y[chunk : chunk + 700])  # fp64 inputs stay fp64
    torch.testing.assert_close(exact.xty, RegressionStats.from_data(x, y).xty, atol=1e-9, rtol=1e-12)
    merged = RegressionStats.from_data(x[:1000], y[:1000]).merge(RegressionStats.from_data(x[1000:], y[1000:]))
    torch.testing.assert_close(merged.xty, RegressionStats.from_data(x, y).xty)
    f1 = fit_linear(streamed, alpha=0.1, bias="regularized")
    f2 = fit_linear(whole, alpha=0.1, bias="regularized")
    torch.testing.assert_close(f1[0], f2[0])


def test_weighted_rows_count_as_repeated_rows(gen):
    """A row of weight 2 is that row twice; weight 0 drops it; the weights' total is the row count."""
    x, w, b = _data(gen)
    y = x @ w + b + 0.1 * torch.randn(3000, 8, generator=gen, dtype=torch.float64)
    weights = torch.ones(3000, dtype=torch.float64)
    weights[:500], weights[500:1000] = 2.0, 0.0
    weighted = RegressionStats.zeros(12, 8)
    weighted.update(x, y, weights)
    repeated = RegressionStats.from_data(torch.cat([x[:500], x[:500], x[1000:]]), torch.cat([y[:500], y[:500], y[1000:]]))
    assert weighted.n == repeated.n == 3000
    for name in ("sum_x", "sum_y", "xtx", "xty", "yty"):
        torch.testing.assert_close(getattr(weighted, name), getattr(repeated, name))
    torch.testing.assert_close(fit_linear(weighted, alpha=0.1, bias="regularized")[0],
                               fit_linear(repeated, alpha=0.1, bias="regularized")[0])
    with pytest.raises(ValueError, match="weights have shape"):
        weighted.update(x, y, weights[:10])


def test_errors_from_statistics_match_direct_computation(gen):
    x, w, b = _data(gen)
    y = x @ w + b + 0.1 * torch.randn(3000, 8, generator=gen, dtype=torch.float64)
    stats = RegressionStats.from_data(x, y)
    fw, fb = fit_linear(stats, alpha=0.01, bias="free")
    resid = y - (x @ fw.double() + fb.double())
    assert stats.sse(fw, fb) == pytest.approx(float((resid**2).sum()), rel=1e-4)
    assert stats.relative_error(fw, fb) == pytest.approx(float((resid**2).sum() / (y**2).sum()), rel=1e-4)
    assert stats.r2(fw, fb) == pytest.approx(1 - float((resid**2).sum() / ((y - y.mean(0)) ** 2).sum()), rel=1e-4)


def test_select_inputs(gen):
    x, _, _ = _data(gen)
    y = x[:, [2, 5]] @ torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    sub = RegressionStats.from_data(x, y).select_inputs([2, 5])
    fw, _ = fit_linear(sub, alpha=0.0)
    torch.testing.assert_close(fw.double(), torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64))


def test_ill_conditioned_inputs_without_any_inverse(gen, monkeypatch):
    """Accurate on badly conditioned X, and no explicit inverse is ever formed."""
    def forbidden(*_a, **_k):
        raise AssertionError("explicit inverse used")

    for name in ("inv", "inv_ex", "pinv"):
        monkeypatch.setattr(torch.linalg, name, forbidden)
    monkeypatch.setattr(torch, "inverse", forbidden)
    p, q = 10, 4
    basis, _ = torch.linalg.qr(torch.randn(p, p, generator=gen, dtype=torch.float64))
    x = torch.randn(5000, p, generator=gen, dtype=torch.float64) @ torch.diag(torch.logspace(0, -5, p, dtype=torch.float64)) @ basis
    w = torch.randn(p, q, generator=gen, dtype=torch.float64)
    stats = RegressionStats.from_data(x, x @ w)
    fw, _ = fit_linear(stats, alpha=0.0)
    pred = x @ fw.double()
    assert float((pred - x @ w).norm() / (x @ w).norm()) < 1e-5
    torch.testing.assert_close(fw.double(), w, atol=5e-3, rtol=1e-3)


def test_singular_system_falls_back_to_least_squares():
    gram = torch.zeros(3, 3, dtype=torch.float64)
    gram[0, 0] = 4.0
    rhs = torch.tensor([[8.0], [0.0], [0.0]], dtype=torch.float64)
    sol = solve_regularized(gram, rhs, 0.0)
    torch.testing.assert_close(sol, torch.tensor([[2.0], [0.0], [0.0]], dtype=torch.float64))


def test_empty_stats_and_bad_prior_are_errors():
    with pytest.raises(ValueError, match="no data"):
        fit_linear(RegressionStats.zeros(3, 3), alpha=1.0)
    stats = RegressionStats.from_data(torch.randn(10, 3), torch.randn(10, 2))
    with pytest.raises(ValueError, match="prior has shape"):
        fit_linear(stats, alpha=1.0, prior=torch.eye(3))
