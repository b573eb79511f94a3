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


# ---- issue 16: the trailing run as a plain causal continuation, interior tokens in one pass ----------------

def _old_masked_repair(model, layers, input_ids, positions):
    """The pre-issue-16 `repair_tokens`: every repaired token appended after all n cached ones, one dense mask.

    Kept here verbatim as the reference semantics the new passes must reproduce.
    """
    from mappings.cache_io import build_cache

    n = input_ids.shape[1]
    pos = sorted({int(p) for p in positions})
    p = torch.tensor(pos)
    dtype = layers[0][0].dtype
    cache = build_cache(layers, config=model.config)
    old = torch.arange(n)
    see_old = (old[None, :] < p[:, None]) & ~torch.isin(old, p)[None, :]
    see_new = p[None, :] <= p[:, None]
    allowed = torch.cat([see_old, see_new], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    _, cache, _ = forward_with_cache(model, input_ids[:, p], cache, position_ids=p[None],
                                     attention_mask=mask[None, None], logits_to_keep=1)
    out = []
    for (k, v), (nk, nv) in zip(layers, cache_layers(cache), strict=True):
        k, v = k.clone(), v.clone()
        k[:, :, p] = nk[:, :, n:]
        v[:, :, p] = nv[:, :, n:]
        out.append((k, v))
    return out


def _noisy_layers(model, ids, seed=1):
    _, cache = prefill(model, ids)
    gen = torch.Generator().manual_seed(seed)
    true = list(cache_layers(cache))
    return true, [(k + 0.3 * torch.randn(k.shape, generator=gen), v + 0.3 * torch.randn(v.shape, generator=gen))
                  for k, v in true]


POSITION_SETS = {
    "sink+tail": [0, 1, 2, 3, *range(30, 40)],
    "sink+one interior run+tail": [0, 1, 2, 3, 12, 13, 14, *range(34, 40)],
    "sink+scattered+tail": [0, 1, 2, 3, 7, 9, 10, 20, 27, *range(35, 40)],
    "scattered, no sink, no tail": [5, 6, 11, 25],
    "everything": list(range(40)),
}


@pytest.mark.parametrize("which", list(POSITION_SETS))
def test_new_passes_equal_the_old_masked_pass(tiny_family, which):
    """Same K/V as the old one-pass masked repair, on every tiny architecture (GQA llama and mistral, MHA
    qwen2; sdpa, no flash), whatever order the positions come in and whichever path runs first; the input
    cache is never modified."""
    from mappings.recompute import repair_tokens

    model = load(tiny_family.child)
    ids = _ids()
    _, noisy = _noisy_layers(model, ids)
    before = [(k.clone(), v.clone()) for k, v in noisy]
    pos = POSITION_SETS[which]
    old_first = _old_masked_repair(model, noisy, ids, pos)
    new = repair_tokens(model, noisy, ids, pos)
    new_reversed = repair_tokens(model, noisy, ids, list(reversed(pos)))
    old_last = _old_masked_repair(model, noisy, ids, list(reversed(pos)))
    for (k, v), (rk, rv), (ok, ov), (lk, lv), (bk, bv) in zip(new, new_reversed, old_first, old_last, before,
                                                               strict=True):
        torch.testing.assert_close(k, ok, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(v, ov, atol=2e-5, rtol=1e-4)
        assert torch.equal(k, rk) and torch.equal(v, rv)
        assert torch.equal(ok, lk) and torch.equal(ov, lv)
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[pos] = False
        assert torch.equal(k[..., untouched, :], bk[..., untouched, :])  # kept positions copied bit for bit
        assert torch.equal(v[..., untouched, :], bv[..., untouched, :])
    for (k, v), (bk, bv) in zip(noisy, before, strict=True):
        assert torch.equal(k, bk) and torch.equal(v, bv)


def test_copying_path_and_eager_attention_give_the_same_repair(llama_family, monkeypatch):
    """The cache that writes straight into the output and the cut-and-copy fallback agree, under eager too."""
    from transformers import AutoModelForCausalLM

    import mappings.recompute as rc

    ids = _ids()
    pos = POSITION_SETS["sink+scattered+tail"]
    for impl in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(str(llama_family.child), attn_implementation=impl).eval()
        _, noisy = _noisy_layers(model, ids)
        direct = rc.repair_tokens(model, noisy, ids, pos)
        with monkeypatch.context() as m:
            m.setattr(rc, "_cache_into", lambda *a, **k: None)
            copied = rc.repair_tokens(model, noisy, ids, pos)
        reference = _old_masked_repair(model, noisy, ids, pos)
        for (k, v), (ck, cv), (rk, rv) in zip(direct, copied, reference, strict=True):
            torch.testing.assert_close(k, ck, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(v, cv, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(k, rk, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(v, rv, atol=2e-5, rtol=1e-4)


def test_kept_logits_are_the_tail_recomputed_over_the_repaired_prefix(llama_family):
    from mappings.apply import tail_recompute
    from mappings.cache_io import build_cache, slice_layers
    from mappings.recompute import repair_tokens_and_logits

    model = load(llama_family.child)
    ids = _ids()
    _, noisy = _noisy_layers(model, ids)
    # the repair's tail (4 tokens) is shorter than the 8 logits asked for: the last 8 are recomputed
    layers, logits = repair_tokens_and_logits(model, noisy, ids, [0, 1, 2, 3, 36, 37, 38, 39], logits=8)
    want_logits, want = tail_recompute(model, build_cache(slice_layers(layers, 0, 32), model.config), ids, 8)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-4)
    for (k, _v), (wk, _wv) in zip(layers, cache_layers(want), strict=True):
        torch.testing.assert_close(k, wk, atol=1e-5, rtol=1e-4)
    assert repair_tokens_and_logits(model, noisy, ids, [], logits=0)[1] is None


class _PassCounter:
    """Records, for every forward pass of a model: tokens fed, cached positions before them, their positions."""

    def __init__(self, model) -> None:
        from mappings.cache_io import cache_kwarg

        self.passes: list[tuple[int, int]] = []
        self.positions: list[int] = []
        kw = cache_kwarg(model)

        def hook(module, args, kwargs):
            cache = kwargs.get(kw)
            past = int(cache.get_seq_length()) if cache is not None else 0
            self.passes.append((int(kwargs["input_ids"].shape[-1]), past))
            self.positions.extend(int(p) for p in kwargs["position_ids"][0])

        self._handle = model.register_forward_pre_hook(hook, with_kwargs=True)

    @property
    def tokens(self) -> int:
        return sum(q for q, _ in self.passes)

    @property
    def keys(self) -> int:
        """Query-key pairs scored per layer and head: each pass's queries against every key it holds."""
        return sum(q * (past + q) for q, past in self.passes)

    def remove(self) -> None:
        self._handle.remove()


def test_repair_costs_what_it_plans_in_operations(llama_family):
    """Operation counts, not seconds: the target is fed exactly the planned tokens (token share x n), the
    sinks are a 4-token prefill and the tail attends to the document once (n keys per query) — the old pass
    attended every repaired token to n + k keys — and the planned cost counts exactly those passes."""
    from mappings.recompute import token_passes
    from mappings.repair import RepairPolicy, compute_share, repair_cache

    model = load(llama_family.child)
    n = 160
    ids = torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(3))
    _, noisy = _noisy_layers(model, ids)
    for budget in (0.1, 0.25, 0.5):
        counter = _PassCounter(model)
        try:
            res = repair_cache(model, noisy, ids, RepairPolicy(budget=budget, sink_tokens=4))
        finally:
            counter.remove()
        k, t = len(res.plan.tokens), res.plan.tail
        assert counter.tokens == k == round(res.plan.token_share * n)  # the tokens fed are the planned ones, exactly
        assert res.plan.cost == pytest.approx(compute_share(model.config, n, res.plan.tokens))
        assert res.plan.cost <= budget
        assert counter.passes == [(4, 0), (t, n - t)]  # sinks from scratch, then the tail over the rest
        assert sorted(counter.positions) == list(res.plan.tokens)  # every planned position once, nothing else
        assert counter.keys == 4 * 4 + t * n < k * (n + k)
        assert counter.passes == token_passes(n, res.plan.tokens)  # what the cost model counts is what runs
        # beyond the causal minimum (each query against the keys up to itself, what a causal kernel scores)
        # only the upper triangles of the two blocks are scored
        causal_minimum = sum(p + 1 for p in res.plan.tokens)
        assert counter.keys - causal_minimum == t * (t - 1) // 2 + 4 * 3 // 2
    # scattered interior tokens share one pass whose keys stop at the last of them
    pos = [0, 1, 2, 3, 40, 41, 90, 120, *range(150, n)]
    counter = _PassCounter(model)
    try:
        from mappings.recompute import repair_tokens

        repair_tokens(model, noisy, ids, pos)
    finally:
        counter.remove()
    assert counter.passes == [(4, 0), (4, 121), (10, 150)] == token_passes(n, pos) and counter.tokens == len(pos)
    assert token_passes(n, [7, 8, 9]) == [(3, 7)] and token_passes(n, range(n)) == [(n, 0)] and token_passes(n, []) == []
    assert token_passes(n, [5, 9, 20], flash=True) == [(1, 5), (1, 9), (1, 20)]


def test_compute_share_counts_attention(llama_family):
    """The plan's cost is its attention-counting compute: a full repair is one prefill; a tail costs more than its
    token share (its queries score ~n keys each, a prefill's n / 2 on average); a config without sizes gives None
    and the plan falls back to the token share."""
    from types import SimpleNamespace

    from mappings.repair import RepairPolicy, compute_share, plan_repair

    cfg = load(llama_family.child).config
    n = 400
    assert compute_share(cfg, n, range(n)) == pytest.approx(1.0)
    plan = plan_repair(RepairPolicy(budget=0.2), n, cfg.num_hidden_layers, config=cfg)
    assert plan.cost > plan.token_share and plan.cost <= 0.2
    d, h, hd, kvh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    linear = 2 * d * h * hd + 2 * d * kvh * hd + 3 * d * cfg.intermediate_size
    att, t = 2 * h * hd, plan.tail
    want = (4 * linear + att * 10 + t * linear + att * t * n) / (n * linear + att * n * (n + 1) / 2)
    assert plan.cost == pytest.approx(want)
    assert compute_share(SimpleNamespace(), n, [1, 2]) is None
    linear_plan = plan_repair(RepairPolicy(budget=0.2), n, 4)
    assert linear_plan.cost == linear_plan.token_share == pytest.approx(0.2)
