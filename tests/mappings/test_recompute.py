"""Recomputing layer blocks and tokens reproduces the target's own prefill exactly."""

from __future__ import annotations

import pytest
import torch

from mappings.cache_io import cache_layers, forward_with_cache, prefill
from mappings.errors import ShapeMismatchError
from mappings.recompute import embed, repair_tokens, run_layers, runs
from tests.mappings.conftest import load


def _ids(n: int = 40, vocab: int = 300) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(0))


def _hidden_and_cache(model, ids):
    logits, cache, out = forward_with_cache(model, ids, None, output_hidden_states=True)
    return out.hidden_states, list(cache_layers(cache))


def test_full_block_from_embeddings_is_the_prefill(tiny_family):
    model = load(tiny_family.child)
    ids = _ids()
    _, true = _hidden_and_cache(model, ids)
    n_layers = len(true)
    _, kv = run_layers(model, embed(model, ids), 0, n_layers)
    for (k, v), (tk, tv) in zip(kv, true, strict=True):
        torch.testing.assert_close(k, tk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, tv, atol=1e-5, rtol=1e-4)


def test_block_from_a_middle_hidden_state(tiny_family):
    model = load(tiny_family.child)
    ids = _ids()
    hidden, true = _hidden_and_cache(model, ids)
    h_out, kv = run_layers(model, hidden[1], 1, 3)
    assert len(kv) == 2
    for (k, v), (tk, tv) in zip(kv, true[1:3], strict=True):
        torch.testing.assert_close(k, tk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, tv, atol=1e-5, rtol=1e-4)
    if len(true) > 3:  # hidden_states[-1] is after the final norm, so compare only inner ones
        torch.testing.assert_close(h_out, hidden[3], atol=1e-5, rtol=1e-4)
    # a perturbed input changes the block's K/V: the block really runs on what it is given
    _, bad = run_layers(model, hidden[1] + 0.5 * torch.randn_like(hidden[1]), 1, 3)
    assert (bad[1][0] - true[2][0]).abs().max() > 1e-2


def test_repair_tokens_restores_exact_kv_after_a_true_prefix(tiny_family):
    model = load(tiny_family.child)
    ids = _ids()
    _, cache = prefill(model, ids)
    true = list(cache_layers(cache))
    noisy = [(k + 0.3 * torch.randn_like(k), v + 0.3 * torch.randn_like(v)) for k, v in true]
    # positions 0..3 (a sink run whose prefix is empty) become exact regardless of the rest
    fixed = repair_tokens(model, noisy, ids, [0, 1, 2, 3])
    for (k, v), (tk, tv), (nk, _nv) in zip(fixed, true, noisy, strict=True):
        torch.testing.assert_close(k[..., :4, :], tk[..., :4, :], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v[..., :4, :], tv[..., :4, :], atol=1e-5, rtol=1e-4)
        assert torch.equal(k[..., 4:, :], nk[..., 4:, :])  # other positions untouched
    # repairing every position, in order, rebuilds the whole prefill
    full = repair_tokens(model, noisy, ids, [*range(0, 10), *range(10, 40)])
    for (k, _v), (tk, _tv) in zip(full, true, strict=True):
        torch.testing.assert_close(k, tk, atol=1e-4, rtol=1e-3)


def test_runs_and_bad_blocks(llama_family):
    assert runs([5, 1, 2, 3, 9, 8]) == [(1, 4), (5, 6), (8, 10)]
    model = load(llama_family.child)
    ids = _ids(8)
    with pytest.raises(ShapeMismatchError, match="outside"):
        run_layers(model, embed(model, ids), 2, 99)
    _, cache = prefill(model, ids)
    with pytest.raises(ShapeMismatchError, match="outside"):
        repair_tokens(model, list(cache_layers(cache)), ids, [7, 8])


def test_one_pass_repair_equals_run_by_run(tiny_family):
    """The masked single pass gives what left-to-right runs give, for scattered positions."""
    from mappings.recompute import _repair_runs

    model = load(tiny_family.child)
    ids = _ids()
    _, cache = prefill(model, ids)
    gen = torch.Generator().manual_seed(1)
    noisy = [(k + 0.3 * torch.randn(k.shape, generator=gen), v + 0.3 * torch.randn(v.shape, generator=gen))
             for k, v in cache_layers(cache)]
    pos = [0, 1, 7, 8, 9, 20, 33, 38, 39]
    one = repair_tokens(model, noisy, ids, pos)
    seq = _repair_runs(model, noisy, ids, pos)
    for (k, v), (sk, sv) in zip(one, seq, strict=True):
        torch.testing.assert_close(k, sk, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(v, sv, atol=1e-4, rtol=1e-3)
