"""Issue 16 goal 3: an adaptive repair ladder picks, per request, the smallest budget whose probe passes."""

from __future__ import annotations

import pytest

from mappings.repair import RepairPolicy, compute_share
from orchestra.family.corpus import data_text
from orchestra.familycache import CachePolicy, FamilyCache
from orchestra.familycache.gates import GatePolicy
from orchestra.models.registry import ModelRegistry

LADDER = (0.1, 0.2, 0.3)
TAIL = 16


@pytest.fixture(scope="module")
def mapstore(tmp_path_factory):
    """Maps fitted on every position (`anchored`: no exact sinks), so with sink_tokens=0 the passes counted
    below are the ladder's alone (a served map's sinks are the map step's: test_core)."""
    from orchestra.familycache.mapping_store import MappingStore

    corpus = [("mpl", data_text("mpl-2.0.txt")[:6000]), ("apache", data_text("apache-2.0.txt")[:6000])]
    return MappingStore(tmp_path_factory.mktemp("plain-maps"), tokens=2048, corpus=corpus, method="anchored")


@pytest.fixture(scope="module")
def registry(fam):
    return ModelRegistry({"base": str(fam.parent), "child": str(fam.child)}, default_device="cpu")


def _gate(max_excess_nll: float) -> GatePolicy:
    return GatePolicy.model_validate({"offline": None, "probe": {"tokens": TAIL, "max_excess_nll": max_excess_nll,
                                                                 "max_excess_kl": 100.0}})


def _cache(registry, mapstore, gate: GatePolicy, repair: RepairPolicy) -> FamilyCache:
    # sink_tokens=0: the passes counted here are the ladder's alone (exact sinks are the map step's, test_core);
    # budgets in multiply-adds, so the rungs recompute what the counts below expect (timed pricing: test_core)
    return FamilyCache(registry, mapstore, source="base",
                       policy=CachePolicy(gate=gate, repair=repair, tail_tokens=TAIL, min_mapped_tokens=16,
                                          sink_tokens=0, repair_costs="compute"))


@pytest.fixture(scope="module")
def doc(registry, mapstore):
    ids = registry.load("base").tokenizer(data_text("gpl-3.txt")[3000:6000], add_special_tokens=False)["input_ids"]
    ids = ids[:300]
    # measure the pair's probe reference (and calibrate the mapping) once, outside what the tests count
    cache = _cache(registry, mapstore, _gate(100.0), RepairPolicy())
    cache.acquire_sync("base", ids).release()
    cache.acquire_sync("child", ids).release()
    return ids


class Positions:
    """Positions fed to a model, one list per forward pass."""

    def __init__(self, model) -> None:
        self.passes: list[list[int]] = []
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        self.passes.append([int(p) for p in kwargs["position_ids"][0]])

    def remove(self) -> None:
        self._handle.remove()


def _acquire(registry, mapstore, doc, gate, repair):
    cache = _cache(registry, mapstore, gate, repair)
    cache.acquire_sync("base", doc).release()
    steps = []
    counter = Positions(registry.load("child").model)
    try:
        lease = cache.acquire_sync("child", doc, on_step=steps.append)
    finally:
        counter.remove()
    lease.release()
    return lease, steps, counter.passes


def _rungs(passes: list[list[int]], n: int) -> list[list[int]]:
    """The positions of each ladder rung: its passes, up to the probe pass that ends at the last position."""
    out: list[list[int]] = [[]]
    for pass_ in passes:
        out[-1].extend(pass_)
        if pass_[-1] == n - 1:
            out.append([])
    return out[:-1]


def test_a_pass_at_budget_zero_spends_nothing(registry, mapstore, doc):
    lease, steps, passes = _acquire(registry, mapstore, doc, _gate(100.0), RepairPolicy(ladder=LADDER))
    assert lease.path == "mapped"
    ladder = lease.repair["ladder"]
    assert ladder["passed"] == 0.0 and ladder["spent"] == 0.0 and ladder["repaired"] == 0
    assert [s["budget"] for s in ladder["steps"]] == [0.0] and lease.repair["tokens"] == 0
    assert passes == [list(range(len(doc) - TAIL, len(doc)))]  # only the probe every map recomputes
    assert [s.tokens for s in steps if s.step == "repair"] == [0]


def test_a_failing_probe_climbs_to_the_smallest_passing_budget(registry, mapstore, doc):
    # first, every rung's probe excess (an unpassable gate climbs the whole ladder) ...
    probe_all = RepairPolicy(ladder=LADDER, max_spend=5.0)
    lease, steps, _ = _acquire(registry, mapstore, doc, _gate(-100.0), probe_all)
    ladder = next(s for s in steps if s.step == "repair").detail.ladder
    excess = [s.metrics["excess_nll"] for s in ladder.steps]
    assert len(excess) == 4 and ladder.passed is None
    # ... then a threshold between the pure map's excess and a lower rung's: the ladder stops there
    j = next(i for i in range(1, 4) if excess[i] < min(excess[:i]))
    threshold = (excess[j] + min(excess[:j])) / 2
    lease, steps, passes = _acquire(registry, mapstore, doc, _gate(threshold), probe_all)
    got = lease.repair["ladder"]
    assert lease.path == "mapped" and got["passed"] == probe_all.rungs[j] and len(got["steps"]) == j + 1
    assert [s["passed"] for s in got["steps"]] == [False] * j + [True]
    assert all(g.passed for g in lease.gates)
    n = len(doc)
    assert got["token_share"] == pytest.approx((sum(map(len, passes)) - TAIL) / n)
    # the spend is in the budget's measure: each rung's passes in compute (attention counted), less the first probe
    config = registry.load("child").model.config
    rungs = _rungs(passes, n)
    assert len(rungs) == j + 1
    want = sum(compute_share(config, n, r) for r in rungs) - compute_share(config, n, range(n - TAIL, n))
    assert got["spent"] == pytest.approx(want) and got["spent"] > got["token_share"]
    assert probe_all.rungs[j] - 2 / n < lease.repair["cost"] <= probe_all.rungs[j]
    assert lease.repair["token_share"] < lease.repair["cost"]


def test_an_unpassable_gate_reprefills_with_the_reason_and_the_spend(registry, mapstore, doc):
    n = len(doc)
    lease, steps, passes = _acquire(registry, mapstore, doc, _gate(-100.0), RepairPolicy(ladder=LADDER))
    assert lease.path == "reprefilled"
    reason = lease.fallback_reason
    assert reason.startswith("probe gate failed") and "repair ladder tried 0%, 10%, 20%, 30%" in reason
    ladder = next(s for s in steps if s.step == "repair").detail.ladder
    assert f"spending {ladder.spent:.1%} of a prefill" in reason and ladder.spent > 0
    assert next(s for s in steps if s.step == "fallback").reason == reason
    # repaired positions are recomputed once; only the probe tokens again, once per rung
    ladder_passes = [p for p in passes if p != list(range(n))]  # the fallback's own prefill left out
    flat = [p for pass_ in ladder_passes for p in pass_]
    probe = set(range(n - TAIL, n))
    outside = [p for p in flat if p not in probe]
    assert len(outside) == len(set(outside)) == ladder.repaired > 0
    assert all(flat.count(p) == len(ladder.steps) for p in probe)
    assert ladder.recomputed == len(flat)


def test_spend_cap_stops_the_climb_early(registry, mapstore, doc):
    lease, steps, _ = _acquire(registry, mapstore, doc, _gate(-100.0), RepairPolicy(ladder=LADDER, max_spend=0.15))
    ladder = next(s for s in steps if s.step == "repair").detail.ladder
    assert lease.path == "reprefilled" and "max_spend" in lease.fallback_reason
    assert ladder.spent <= 0.15 and len(ladder.steps) < 4


def test_without_a_probe_gate_the_ladder_repairs_at_its_first_budget(registry, mapstore, doc):
    gate = GatePolicy.model_validate({"offline": None, "probe": None})
    lease, _, _ = _acquire(registry, mapstore, doc, gate, RepairPolicy(budget=0.1, ladder=(0.2,)))
    assert lease.path == "mapped" and "ladder" not in lease.repair
    n = len(doc)  # 10 % of the compute: fewer than 10 % of the tokens (the tail's tokens score ~n keys each)
    assert 0.1 - 2 / n < lease.repair["cost"] <= 0.1 and lease.repair["tokens"] < int(0.1 * n)
    assert lease.repair["token_share"] == pytest.approx(lease.repair["tokens"] / n)


def test_a_ladder_with_scattered_tokens_ranks_them_once_on_the_source(registry, mapstore, doc):
    policy = RepairPolicy(ladder=LADDER, scattered_share=0.5, probe_tokens=8)
    lease, steps, _ = _acquire(registry, mapstore, doc, _gate(-100.0), policy)
    detail = next(s for s in steps if s.step == "repair").detail
    assert lease.path == "reprefilled" and detail.scattered > 0 and len(detail.ladder.steps) == 4
