"""Map, then repair: planning under a budget, and repaired caches moving toward the target's own."""

from __future__ import annotations

import math

import pytest
import torch

from mappings.cache_io import build_cache, cache_layers, forward_with_cache, prefill
from mappings.metrics import next_token_agreement
from mappings.repair import (
    RepairPolicy,
    RepairUnavailableError,
    attention_importance,
    choose_blocks,
    compute_share,
    plan_repair,
    repair_cache,
)
from tests.mappings.conftest import load


def _ids(n: int = 48) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(2))


def _smollm2_config():
    """SmolLM2-135M's shapes, as a config object only (no weights)."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, intermediate_size=1536, vocab_size=49152)


def test_plan_spends_the_budget_on_sink_and_tail():
    """Without the target's sizes the plan is the token plan: k = floor(budget * n) tokens, cost = k / n."""
    plan = plan_repair(RepairPolicy(budget=0.1, sink_tokens=4), n=1000, num_layers=30)
    assert plan.tokens[:4] == (0, 1, 2, 3) and plan.tail == 96 and plan.tokens[-1] == 999
    assert len(plan.tokens) == 100 and plan.blocks == () and plan.cost == pytest.approx(0.1)
    assert plan.token_share == plan.cost
    assert plan_repair(RepairPolicy(budget=0.0), n=1000, num_layers=30).tokens == ()


@pytest.mark.parametrize("n", [200, 1000, 4096])
@pytest.mark.parametrize("budget", [0.02, 0.1, 0.25, 0.6])
def test_plan_is_the_largest_whose_compute_fits_the_budget(n, budget):
    """The budget bounds the plan's compute share (attention counted); one more tail token would pass it."""
    cfg = _smollm2_config()
    plan = plan_repair(RepairPolicy(budget=budget), n, 30, config=cfg)
    assert plan.cost == pytest.approx(compute_share(cfg, n, plan.tokens)) and plan.cost <= budget + 1e-12
    assert plan.token_share == pytest.approx(len(plan.tokens) / n)
    assert plan.tokens[:4] == (0, 1, 2, 3)  # the sinks first (at 2 % of 200 tokens, nothing else fits)
    assert plan.tokens[len(plan.tokens) - plan.tail :] == tuple(range(n - plan.tail, n))
    assert plan.tail > 0 or (budget, n) == (0.02, 200)
    one_more = sorted({*plan.tokens, n - plan.tail - 1})
    assert compute_share(cfg, n, one_more) > budget
    # with layer blocks the tokens get what the blocks leave (3 of 30 layers: 10 %), in the same measure
    if budget > 0.1:
        blocks = plan_repair(RepairPolicy(budget=budget, blocks=((0, 3),)), n, 30, config=cfg)
        assert blocks.cost == pytest.approx(compute_share(cfg, n, blocks.tokens, 3)) and blocks.cost <= budget + 1e-12
        assert blocks.tail > 0 and compute_share(cfg, n, sorted({*blocks.tokens, n - blocks.tail - 1}), 3) > budget


def test_plan_with_scattered_tokens_fits_the_compute_budget():
    cfg = _smollm2_config()
    n = 2048
    importance = torch.linspace(0, 1, n).flip(0)  # earliest positions first
    plan = plan_repair(RepairPolicy(budget=0.15, scattered_share=0.25), n, 30, config=cfg, importance=importance)
    assert plan.scattered > 0 and plan.cost == pytest.approx(compute_share(cfg, n, plan.tokens))
    assert plan.cost <= 0.15 + 1e-12
    bigger = plan_repair(RepairPolicy(budget=0.2, scattered_share=0.25), n, 30, config=cfg, importance=importance)
    assert len(bigger.tokens) > len(plan.tokens) and plan.cost < bigger.cost <= 0.2 + 1e-12


def test_a_full_budget_is_one_prefill():
    cfg = _smollm2_config()
    plan = plan_repair(RepairPolicy(budget=1.0), 500, 30, config=cfg)
    assert plan.tokens == tuple(range(500)) and plan.cost == pytest.approx(1.0) and plan.token_share == 1.0


def test_unknown_shapes_give_the_token_plan():
    """A config without the model's sizes (or none) plans by token share, exactly as before attention counted."""
    from types import SimpleNamespace

    importance = torch.zeros(1000)
    importance[500] = 5.0
    for policy in (RepairPolicy(budget=0.1), RepairPolicy(budget=0.37, sink_tokens=0),
                   RepairPolicy(budget=0.2, scattered_share=0.1), RepairPolicy(budget=0.2, blocks=((0, 3),))):
        old = plan_repair(policy, 1000, 30, importance=importance)
        for config in (None, SimpleNamespace(), SimpleNamespace(hidden_size=64)):
            assert plan_repair(policy, 1000, 30, importance=importance, config=config) == old
        blocks = sum(z - a for a, z in old.blocks)
        assert len(old.tokens) == int(math.floor((policy.budget - blocks / 30) * 1000 + 1e-9))
        assert old.cost == old.token_share == pytest.approx(len(old.tokens) / 1000 + blocks / 30)


def test_ten_percent_at_4k_on_smollm2_shapes_recomputes_fewer_than_ten_percent_of_the_tokens():
    """A trailing token scores ~n keys, an average prefill token n / 2: at 4,096 tokens on a 135M model attention
    is a large share of a layer's work, so 10 % of the compute buys clearly fewer than 10 % of the tokens."""
    n = 4096
    plan = plan_repair(RepairPolicy(budget=0.1), n, 30, config=_smollm2_config())
    assert plan.tail < 0.1 * n and len(plan.tokens) < 0.1 * n
    assert plan.token_share < 0.09 and 0.095 < plan.cost <= 0.1
    assert len(plan_repair(RepairPolicy(budget=0.1), n, 30).tokens) == int(0.1 * n)  # the token plan, for contrast


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
    assert plan.cost == plan.token_share == pytest.approx(len(plan.tokens) / 1000 + 0.1)
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
    # (KL against the tail length is not monotone on this 40-token noised cache: on llama a 15-token tail is worse
    # than a 5-token one, a 16-token one barely better; so the sink-and-tail repair is held against the map only)
    kls = [_kl(model, repair_cache(model, noisy, prefix, RepairPolicy(budget=b)).layers, true, suffix)
           for b in (0.0, 0.25)]
    assert kls[0] > kls[1] and kls[0] > 1e-3


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


def test_question_focus_ranks_the_document_by_what_the_question_reads(llama_family):
    """With a focus, the tokens after the document are the queries: their eager attention on its positions,
    renormalised over the document (what they read of it), is the ranking."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_family.child), attn_implementation="eager").eval()
    ids = _ids()[:, :36]
    doc, question = ids[:, :30], ids[0, 30:].tolist()
    _, cache = prefill(model, doc)
    got = attention_importance(model, list(cache_layers(cache)), doc, probe_tokens=5, focus=question)
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    # softmax over the document's keys only: the full row's weights on them, renormalised
    want = torch.stack([(a[0, :, 30:, :30] / a[0, :, 30:, :30].sum(-1, keepdim=True)).float().mean(dim=(0, 1))
                        for a in out.attentions]).mean(0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
    assert not torch.allclose(got, attention_importance(model, list(cache_layers(cache)), doc, probe_tokens=5),
                              atol=1e-3)
    policy = RepairPolicy(budget=0.2, scattered_share=1.0, focus=tuple(question))
    assert policy.label.endswith(",Q") and policy != policy.model_copy(update={"focus": None})


# ---- issue 16: the adaptive budget ladder ------------------------------------------------------------------

def test_ladder_policy_validation_and_rungs():
    from pydantic import ValidationError

    policy = RepairPolicy(ladder=(0.1, 0.02, 0.05, 0.1))
    assert policy.adaptive and policy.rungs == (0.0, 0.02, 0.05, 0.1) and policy.max_budget == 0.1
    assert policy.label == "repair@0/2/5/10%" and not policy.at(0.05).adaptive and policy.at(0.05).budget == 0.05
    assert RepairPolicy(budget=0.05, ladder=(0.02, 0.2)).rungs == (0.05, 0.2)  # rungs below the start are dropped
    assert RepairPolicy(budget=0.1).rungs == (0.1,) and not RepairPolicy(budget=0.1).adaptive
    with pytest.raises(ValidationError, match="tokens only"):
        RepairPolicy(ladder=(0.1,), layer_share=0.5)
    with pytest.raises(ValidationError, match=r"\[0, 1\]"):
        RepairPolicy(ladder=(1.5,))
    with pytest.raises(RepairUnavailableError, match="climb_repair"):
        repair_cache(None, [(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))], torch.zeros(1, 4, dtype=torch.long),
                     policy)


class _Probe:
    """A probe that passes from its `passes_at`-th call on (never when None), recording each call's logits."""

    def __init__(self, passes_at: int | None) -> None:
        self.passes_at = passes_at
        self.calls: list[torch.Tensor] = []

    def __call__(self, logits):
        self.calls.append(logits)
        ok = self.passes_at is not None and len(self.calls) > self.passes_at
        return ok, {"calls": float(len(self.calls))}


def _positions_fed(model):
    """Positions fed to `model`, one list per forward pass."""
    fed: list[list[int]] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append([int(p) for p in kwargs["position_ids"][0]]), with_kwargs=True)
    return fed, handle


def _rungs(fed: list[list[int]], n: int) -> list[list[int]]:
    """The positions of each ladder rung: its passes, up to the probe pass that ends at the last position."""
    out: list[list[int]] = [[]]
    for pass_ in fed:
        out[-1].extend(pass_)
        if pass_[-1] == n - 1:
            out.append([])
    return out[:-1]


def test_ladder_passing_at_zero_spends_nothing(tiny_family):
    from mappings.repair import climb_repair

    model = load(tiny_family.child)
    ids = _ids(160)
    _, noisy = _noisy(model, ids)
    fed, handle = _positions_fed(model)
    try:
        res = climb_repair(model, noisy, ids, RepairPolicy(ladder=(0.05, 0.1, 0.2)), _Probe(0), tail=16)
    finally:
        handle.remove()
    assert fed == [list(range(144, 160))]  # only the probe tokens every map recomputes
    lad = res.ladder
    assert lad.passed == 0.0 and lad.spent == 0.0 and lad.repaired == 0 and lad.stopped is None
    assert len(lad.steps) == 1 and res.logits.shape[1] == 16 and res.plan.tokens == ()
    for (k, _v), (nk, _nv) in zip(res.layers, noisy, strict=True):
        assert torch.equal(k[..., :144, :], nk[..., :144, :])


def test_ladder_climbs_to_the_first_passing_budget_repairing_each_position_once(llama_family):
    from mappings.recompute import repair_tokens_and_logits
    from mappings.repair import climb_repair

    model = load(llama_family.child)
    n, tail = 200, 16
    ids = torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(5))
    _, noisy = _noisy(model, ids)
    policy = RepairPolicy(ladder=(0.1, 0.2, 0.3, 0.4))
    probe = _Probe(3)  # fails at 0, 10 %, 20 %; passes at 30 %
    fed, handle = _positions_fed(model)
    try:
        res = climb_repair(model, noisy, ids, policy, probe, tail=tail)
    finally:
        handle.remove()
    lad = res.ladder
    assert lad.passed == 0.3 and [s.budget for s in lad.steps] == [0.0, 0.1, 0.2, 0.3]
    assert [s.passed for s in lad.steps] == [False, False, False, True] and lad.stopped is None
    flat = [p for pass_ in fed for p in pass_]
    probe_pos = set(range(n - tail, n))
    outside = [p for p in flat if p not in probe_pos]
    assert len(outside) == len(set(outside)) == lad.repaired  # no repaired position is recomputed twice
    assert all(flat.count(p) == 4 for p in probe_pos)  # the probe tokens once per rung, to re-probe
    cfg = model.config
    assert set(outside) | probe_pos == set(plan_repair(policy.at(0.3), n, len(noisy), config=cfg).tokens) | probe_pos
    assert lad.recomputed == len(flat) and lad.token_share == pytest.approx((len(flat) - tail) / n)
    # the spend is each rung's passes in the budget's measure (compute counting attention), less the first probe
    rungs = _rungs(fed, n)
    assert len(rungs) == 4
    assert lad.spent == pytest.approx(sum(compute_share(cfg, n, r) for r in rungs) - compute_share(cfg, n, probe_pos))
    assert lad.spent > lad.token_share
    assert 0.3 - 2 / n < res.plan.cost <= 0.3 and res.plan.token_share < 0.3
    # the same climb by hand: each rung's new positions plus the probe tokens over the previous rung's cache
    layers, seen = noisy, set()
    for budget in (0.0, 0.1, 0.2, 0.3):
        new = sorted(set(plan_repair(policy.at(budget), n, len(noisy), config=cfg).tokens) - seen - probe_pos)
        layers, logits = repair_tokens_and_logits(model, layers, ids, new, logits=tail)
        seen |= set(new)
    for (k, v), (hk, hv) in zip(res.layers, layers, strict=True):
        torch.testing.assert_close(k, hk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, hv, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(res.logits, logits, atol=1e-5, rtol=1e-4)
    assert torch.equal(probe.calls[-1], res.logits)


def test_ladder_that_never_passes_reports_its_spend_and_stops_at_max_spend(llama_family):
    from mappings.repair import climb_repair

    model = load(llama_family.child)
    n, tail = 200, 16
    ids = torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(6))
    _, noisy = _noisy(model, ids)
    res = climb_repair(model, noisy, ids, RepairPolicy(ladder=(0.1, 0.2)), _Probe(None), tail=tail)
    lad = res.ladder
    assert lad.passed is None and "no budget" in lad.stopped and len(lad.steps) == 3
    assert lad.token_share == pytest.approx((lad.recomputed - tail) / n) and lad.spent > 0.2
    # the 20 % rung would bring the spend over a 25 % cap: the climb stops before it, having spent less
    capped = climb_repair(model, noisy, ids, RepairPolicy(ladder=(0.1, 0.2), max_spend=0.25), _Probe(None), tail=tail)
    assert [s.budget for s in capped.ladder.steps] == [0.0, 0.1]
    assert "max_spend" in capped.ladder.stopped and capped.ladder.spent <= 0.25
    # the cap is in compute, as the budget: a cap the token share of the whole climb fits under, but its compute
    # does not, stops it before its last rung
    assert lad.token_share < lad.spent
    cap = (lad.token_share + lad.spent) / 2
    between = climb_repair(model, noisy, ids, RepairPolicy(ladder=(0.1, 0.2), max_spend=cap), _Probe(None), tail=tail)
    assert "max_spend" in between.ladder.stopped and between.ladder.spent <= cap
    # a rung that adds no position outside the probe tokens is skipped, not probed again
    short = climb_repair(model, noisy, ids, RepairPolicy(budget=0.02, ladder=(0.03,), sink_tokens=0), _Probe(None),
                         tail=tail)
    assert short.ladder.steps[1].model_dump() == {"budget": 0.03, "tokens": 0, "skipped": True}


def test_ladder_probe_sees_the_repairs(llama_family):
    """With a real probe (KL of the probe logits to the truth) the repairs lower it, and a threshold between two
    rungs' values stops the ladder exactly at the first rung under it."""
    from mappings.metrics import mean_kl
    from mappings.repair import climb_repair

    model = load(llama_family.child)
    n, tail = 200, 16
    ids = torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(7))
    true, noisy = _noisy(model, ids)
    cut = build_cache([(k[..., : n - tail, :], v[..., : n - tail, :]) for k, v in true], model.config)
    truth, _, _ = forward_with_cache(model, ids[:, n - tail :], cut)
    policy = RepairPolicy(ladder=(0.25, 0.5, 1.0), max_spend=2.0)

    def probe_under(threshold):
        def probe(logits):
            kl = mean_kl(truth[0], logits[0])
            return kl < threshold, {"kl": kl}
        return probe

    climbed = climb_repair(model, noisy, ids, policy, probe_under(-1.0), tail=tail)
    kls = [s.metrics["kl"] for s in climbed.ladder.steps]
    assert len(kls) == 4 and kls[-1] < kls[0]
    j = next(i for i in range(1, 4) if kls[i] < min(kls[:i]))
    res = climb_repair(model, noisy, ids, policy, probe_under((kls[j] + min(kls[:j])) / 2), tail=tail)
    assert res.ladder.passed == policy.rungs[j] and len(res.ladder.steps) == j + 1
    assert res.ladder.steps[-1].metrics["kl"] == pytest.approx(kls[j])
