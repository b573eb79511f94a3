"""Map, then repair: planning under a budget, and repaired caches moving toward the target's own."""

from __future__ import annotations

import pytest
import torch

from mappings.cache_io import build_cache, cache_layers, forward_with_cache, prefill
from mappings.metrics import next_token_agreement
from mappings.repair import (
    RepairPolicy,
    RepairUnavailableError,
    attention_importance,
    choose_blocks,
    plan_repair,
    repair_cache,
)
from tests.mappings.conftest import load


def _ids(n: int = 48) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(2))


def test_plan_spends_the_budget_on_sink_and_tail():
    plan = plan_repair(RepairPolicy(budget=0.1, sink_tokens=4), n=1000, num_layers=30)
    assert plan.tokens[:4] == (0, 1, 2, 3) and plan.tail == 96 and plan.tokens[-1] == 999
    assert len(plan.tokens) == 100 and plan.blocks == () and plan.cost == pytest.approx(0.1)
    assert plan_repair(RepairPolicy(budget=0.0), n=1000, num_layers=30).tokens == ()


def test_plan_with_layers_and_scattered_tokens():
    scores = [0.0] * 30
    scores[10] = scores[11] = 1.0
    importance = torch.zeros(1000)
    importance[500] = 5.0
    importance[2] = 9.0  # already a sink token: not counted twice
    policy = RepairPolicy(budget=0.2, layer_share=0.5, scattered_share=0.1)
    plan = plan_repair(policy, n=1000, num_layers=30, layer_scores=scores, importance=importance)
    assert plan.blocks == ((10, 13),) or plan.blocks == ((9, 12),)  # 3 layers = 10 % of 30, covering 10-11
    assert 500 in plan.tokens and plan.scattered >= 1
    assert plan.cost == pytest.approx(len(plan.tokens) / 1000 + 0.1)
    assert plan.cost <= 0.2 + 1e-9
    with pytest.raises(RepairUnavailableError, match="per-layer scores"):
        plan_repair(RepairPolicy(budget=0.2, layer_share=1.0), n=100, num_layers=30)


def test_choose_blocks_and_policy_validation():
    assert choose_blocks([0.1, 0.5, 0.4, 0.0], 2) == ((1, 3),)
    assert choose_blocks([1, 2, 3], 0) == ()
    with pytest.raises(ValueError, match="start, stop"):
        RepairPolicy(blocks=((3, 3),))
    assert RepairPolicy(budget=0.1).label == "repair@10%"


def _noisy(model, ids, scale=0.2):
    _, cache = prefill(model, ids)
    true = list(cache_layers(cache))
    gen = torch.Generator().manual_seed(4)
    noisy = [(k + scale * torch.randn(k.shape, generator=gen), v + scale * torch.randn(v.shape, generator=gen))
             for k, v in true]
    return true, noisy


def _kl(model, layers, true, suffix):
    ref, _, _ = forward_with_cache(model, suffix, build_cache(true, model.config))
    got, _, _ = forward_with_cache(model, suffix, build_cache(layers, model.config))
    return next_token_agreement(ref.float(), got.float())["kl"]


def test_full_budget_rebuilds_the_prefill_and_more_budget_helps(tiny_family):
    model = load(tiny_family.child)
    ids = _ids()
    prefix, suffix = ids[:, :40], ids[:, 40:]
    true, noisy = _noisy(model, prefix)
    full = repair_cache(model, noisy, prefix, RepairPolicy(budget=1.0)).layers
    for (k, v), (tk, tv) in zip(full, true, strict=True):
        torch.testing.assert_close(k, tk, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(v, tv, atol=1e-4, rtol=1e-3)
    kls = [_kl(model, repair_cache(model, noisy, prefix, RepairPolicy(budget=b)).layers, true, suffix)
           for b in (0.0, 0.25, 0.5)]
    assert kls[0] > kls[1] > kls[2] and kls[0] > 1e-3


def test_layer_block_from_layer_zero_is_exact(llama_family):
    model = load(llama_family.child)
    ids = _ids()[:, :32]
    true, noisy = _noisy(model, ids)
    res = repair_cache(model, noisy, ids, RepairPolicy(budget=0.5, layer_share=1.0, sink_tokens=0, blocks=((0, 2),)))
    assert res.plan.blocks == ((0, 2),) and res.plan.tokens == ()
    for i in range(2):
        torch.testing.assert_close(res.layers[i][0], true[i][0], atol=1e-4, rtol=1e-3)
    assert torch.equal(res.layers[3][0], noisy[3][0])
    with pytest.raises(RepairUnavailableError, match="residual"):
        repair_cache(model, noisy, ids, RepairPolicy(budget=0.5, layer_share=1.0, blocks=((1, 3),)))


def test_attention_importance_matches_eager_attention(llama_family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_family.child), attn_implementation="eager").eval()
    ids = _ids()[:, :30]
    _, cache = prefill(model, ids)
    layers = list(cache_layers(cache))
    got = attention_importance(model, layers, ids, probe_tokens=5)
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    want = torch.stack([a[0, :, -5:, :].float().mean(dim=(0, 1)) for a in out.attentions]).mean(0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
    assert got.sum().item() == pytest.approx(1.0, abs=1e-4)
