"""Measured pass costs: features of the passes a repair makes, the fit, storage, and plans priced in seconds."""

from __future__ import annotations

import json

import pytest
import torch

from mappings.passcost import (
    FEATURES,
    PassCosts,
    architecture_hash,
    load_or_measure,
    measure_pass_costs,
    pass_features,
    prefill_features,
)
from mappings.recompute import token_passes
from mappings.repair import RepairPolicy, climb_repair, compute_share, plan_repair, repair_cache
from tests.mappings.conftest import load


def _costs(per_pass: float = 0.0, per_token: float = 1.0, per_key: float = 0.0, per_copied: float = 0.0,
           per_past_key: float | None = None, per_past: float = 0.0) -> PassCosts:
    return PassCosts(per_pass=per_pass, per_token=per_token, per_key=per_key,
                     per_past_key=per_key if per_past_key is None else per_past_key, per_past=per_past,
                     per_copied=per_copied)


def test_features_count_what_the_repair_passes_do():
    n = 100
    tokens = [0, 1, 2, 3, *range(90, 100)]
    passes, toks, causal, cached, held, copied = pass_features(n, tokens)
    assert token_passes(n, tokens) == [(4, 0), (10, 90)]
    assert (passes, toks, copied) == (2, 14, 90)  # the copy: the positions before the tail
    assert causal == 4 * 5 / 2 + 10 * 11 / 2  # each pass's queries among its own tokens
    assert cached == 10 * 90  # the tail's ten queries over the 90 cached positions
    assert held == 0 + 90  # the sink pass holds no cache, the tail's pass holds 90 positions, once
    assert pass_features(n, [*tokens[:4], 50, 51, *tokens[4:]])[4] == 0 + 50 + 90  # an interior run's pass too
    assert pass_features(n, tokens, copy=False)[5] == 0 and pass_features(n, [])[0] == 0
    assert prefill_features(8) == (1, 8, 36, 0, 0, 0) and len(FEATURES) == 6


def test_a_pass_over_a_long_cache_pays_for_its_positions_whatever_its_queries():
    """The cached-positions term prices a 4-token tail over 4,096 positions above one over 256."""
    costs = _costs(per_pass=0.05, per_token=0.001, per_key=0.0, per_past_key=5e-7, per_past=2e-5)
    short, long = costs.repair_seconds(256, range(252, 256)), costs.repair_seconds(4096, range(4092, 4096))
    assert long - short == pytest.approx(2e-5 * (4092 - 252) + 5e-7 * 4 * (4092 - 252))


def test_a_per_pass_overhead_makes_small_plans_cost_more_than_their_compute():
    """With a fixed cost per pass a sink pass costs far more than its four tokens: the plan buys fewer tokens."""
    n = 4096
    linear = _costs(per_token=1.0, per_key=0.002)
    overhead = _costs(per_pass=50.0, per_token=1.0, per_key=0.002)
    plain = plan_repair(RepairPolicy(budget=0.05), n, 30, costs=linear)
    taxed = plan_repair(RepairPolicy(budget=0.05), n, 30, costs=overhead)
    assert plain.costs == taxed.costs == "measured"
    assert len(taxed.tokens) < len(plain.tokens)
    for plan, costs in ((plain, linear), (taxed, overhead)):
        assert plan.cost == pytest.approx(costs.share(n, plan.tokens)) and plan.cost <= 0.05 + 1e-12
        assert costs.share(n, sorted({*plan.tokens, n - plan.tail - 1})) > 0.05  # the largest that fits


def test_exact_sinks_are_not_recomputed_but_their_pass_is_paid():
    n = 2048
    cfg = _costs(per_pass=20.0, per_token=1.0, per_key=0.001)
    fresh = plan_repair(RepairPolicy(budget=0.1, sink_tokens=4), n, 30, costs=cfg)
    after_sinks = plan_repair(RepairPolicy(budget=0.1, sink_tokens=4), n, 30, costs=cfg, exact=4)
    assert fresh.tokens[:4] == (0, 1, 2, 3) and after_sinks.exact == 4
    assert not set(range(4)) & set(after_sinks.tokens)
    assert after_sinks.tokens == fresh.tokens[4:] and after_sinks.cost == pytest.approx(fresh.cost)
    # the flops measure too: the sink pass is in the cost, not in the tokens
    from tests.mappings.test_repair import _smollm2_config

    smol = _smollm2_config()
    plan = plan_repair(RepairPolicy(budget=0.1), n, 30, config=smol, exact=4)
    assert plan.costs == "compute" and plan.tokens[0] > 4
    assert plan.cost == pytest.approx(compute_share(smol, n, sorted({0, 1, 2, 3, *plan.tokens})))
    # more exact positions than the policy's sinks: none of them recomputed, all of them paid
    wide = plan_repair(RepairPolicy(budget=0.1, sink_tokens=2), n, 30, config=smol, exact=8)
    assert min(wide.tokens) >= 8 and wide.token_share == pytest.approx((len(wide.tokens) + 8) / n)


def test_measured_costs_fit_the_timed_passes_and_price_plans(tiny_family, tmp_path):
    model = load(tiny_family.parent)
    costs = measure_pass_costs(model, max_tokens=256, repeats=1, key={"architecture": "x"}, measured_on="fp")
    assert min(costs.coefficients) >= 0 and costs.measured_on == "fp"
    assert costs.prefill_seconds(256) >= costs.prefill_seconds(32) > 0  # timings: no strict order asserted
    assert {s["pass"] for s in costs.samples} >= {"prefill 256", "sinks", "tail 4", "tail 16"}
    for s in costs.samples:  # the fit reproduces what it was given
        assert s["fitted"] == pytest.approx(costs.seconds([s[f] for f in FEATURES]))
    # cached keys and cached positions at two cache sizes, with few and with many queries
    assert {"tail 4 of 128", "tail 8 of 128", "tail 16 of 128"} <= {s["pass"] for s in costs.samples}
    share = costs.share(256, range(256 - 32, 256))
    assert share > 0
    # JSON round trip, and a file for other settings is not used
    path = costs.save(tmp_path / "c.json")
    assert PassCosts.load(path, {"architecture": "x"}) == costs
    assert PassCosts.load(path, {"architecture": "y"}) is None
    data = json.loads(path.read_text())
    data["version"] = 99
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert PassCosts.load(tmp_path / "old.json") is None
    assert PassCosts.load(tmp_path / "missing.json") is None


def test_load_or_measure_stores_once_and_reads_back(llama_family, tmp_path):
    import mappings.passcost as pc

    model = load(llama_family.parent)
    said: list[str] = []
    pc._MEASURED.clear()  # timings of this architecture taken by an earlier test in this process
    first = load_or_measure(model, "f" * 64, tmp_path, max_tokens=128, log=said.append)
    files = list(tmp_path.glob("*.json"))
    arch = architecture_hash(model)
    assert len(files) == 1 and files[0].name.startswith(arch[:16]) and said and "timed" in said[0]
    assert first.key["architecture"] == arch and first.measured_on == "f" * 64
    pc._MEASURED.clear()  # a new process: read from the folder, not measured again
    again = load_or_measure(model, "f" * 64, tmp_path, max_tokens=128, log=said.append)
    assert again == first and len(said) == 1
    assert load_or_measure(model, "f" * 64, None) is again  # kept in this process
    # a sibling of the same shape (the child: other weights) is priced by the same timings, not timed again
    child = load(llama_family.child)
    assert architecture_hash(child) == arch
    pc._MEASURED.clear()
    assert load_or_measure(child, "c" * 64, tmp_path, max_tokens=128, log=said.append) == first and len(said) == 1
    # a version-2 file (five coefficients) is measured again, not misread
    data = json.loads(files[0].read_text())
    data["version"] = 2
    files[0].write_text(json.dumps(data))
    assert PassCosts.load(files[0]) is None


def test_architecture_hash_follows_the_shape_not_the_weights_or_the_name(llama_family):
    import copy

    model = load(llama_family.parent)
    arch = architecture_hash(model)
    renamed = copy.deepcopy(model)
    renamed.config._name_or_path = "/elsewhere/model"
    with torch.no_grad():
        next(renamed.parameters()).add_(1.0)
    assert architecture_hash(renamed) == arch
    wider = copy.deepcopy(model)
    wider.config.intermediate_size += 8
    assert architecture_hash(wider) != arch
    halved = copy.deepcopy(model).to(torch.bfloat16)
    assert architecture_hash(halved) != arch


def test_repairs_priced_in_seconds_stay_in_budget_and_skip_exact_sinks(llama_family):
    model = load(llama_family.parent)
    ids = torch.randint(3, 300, (1, 96), generator=torch.Generator().manual_seed(5))
    from mappings.cache_io import cache_layers, forward_with_cache

    _, cache, _ = forward_with_cache(model, ids, None)
    layers = list(cache_layers(cache))
    costs = measure_pass_costs(model, max_tokens=96, repeats=1)
    res = repair_cache(model, layers, ids, RepairPolicy(budget=0.3), costs=costs, exact=4)
    assert res.plan.costs == "measured" and res.summary()["exact"] == 4 and res.summary()["costs"] == "measured"
    # on a tiny model a pass costs about as much as a prefill: the sink pass alone may already be over budget
    assert not set(res.plan.tokens) & {0, 1, 2, 3}
    assert res.plan.cost <= 0.3 + 1e-12 or (not res.plan.tokens and res.plan.cost == pytest.approx(costs.share(96, range(4))))
    whole = repair_cache(model, layers, ids, RepairPolicy(budget=1.0), costs=costs, exact=4)
    assert whole.plan.tokens == tuple(range(4, 96)) and whole.plan.cost == pytest.approx(1.0)

    def probe(logits):
        return False, {"kl": 1.0}

    climb = climb_repair(model, layers, ids, RepairPolicy(budget=0.0, ladder=(1.0,), max_spend=5.0), probe, tail=8,
                         costs=costs, exact=4)
    assert climb.plan.costs == "measured" and climb.plan.tokens == tuple(range(4, 96))
    assert climb.ladder.repaired == 96 - 4 - 8  # the sinks were exact already, the probe tokens are its own
