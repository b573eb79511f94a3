"""FamilyCache on a real tiny family: prefix reuse, cross-member maps, single-flight, budget, model locks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mappings import cache_layers, cache_length
from orchestra.family.corpus import data_text
from orchestra.familycache import CachePolicy, FamilyCache
from orchestra.familycache.gates import GatePolicy
from orchestra.models.registry import ModelRegistry
from tests.waiting import wait_until

PERMISSIVE = GatePolicy.model_validate({"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0,
                                                                   "max_excess_kl": 100.0}})


@pytest.fixture(scope="module")
def registry(fam):
    return ModelRegistry({"base": str(fam.parent), "child": str(fam.child)}, default_device="cpu")


def _family_cache(registry, mapstore, **policy) -> FamilyCache:
    return FamilyCache(registry, mapstore, source="base",
                       policy=CachePolicy(gate=PERMISSIVE, min_mapped_tokens=16, **policy))


def _ids(registry, text: str) -> list[int]:
    return registry.load("base").tokenizer(text, add_special_tokens=False)["input_ids"]


class TokenCounter:
    """Counts the positions each forward pass of a real model computes, and how many passes overlap."""

    def __init__(self, model, delay: float = 0.0) -> None:
        self.tokens: list[int] = []
        self.active = 0
        self.most = 0
        self.delay = delay
        self._lock = threading.Lock()
        self._handles = [model.register_forward_pre_hook(self._enter, with_kwargs=True),
                         model.register_forward_hook(self._exit)]

    def _enter(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        with self._lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.tokens.append(int(ids.shape[-1]) if ids is not None else 0)
        if self.delay:
            time.sleep(self.delay)

    def _exit(self, module, args, output):
        with self._lock:
            self.active -= 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def test_shared_prefix_is_reused_not_recomputed(registry, mapstore):
    cache = _family_cache(registry, mapstore)
    doc = _ids(registry, data_text("gpl-3.txt")[:250])
    first = _ids(registry, " Question one: what is it about?")
    second = _ids(registry, " Another question, entirely different.")
    counter = TokenCounter(registry.load("base").model)
    try:
        a = cache.acquire_sync("base", doc + first)
        b = cache.acquire_sync("base", doc + second)
    finally:
        counter.remove()
    assert a.path == b.path == "exact" and a.computed_tokens == len(doc) + len(first)
    shared = len(doc) + next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert b.reused_tokens == shared and b.computed_tokens == len(doc) + len(second) - shared
    assert counter.tokens == [len(doc) + len(first), len(doc) + len(second) - shared]  # the prefix ran once
    # what was reused is exact: the same as prefilling the second sequence from scratch
    fresh = cache.acquire_sync("base", doc + second, reuse=False)
    for (k1, v1), (k2, v2) in zip(cache_layers(b.cache), cache_layers(fresh.cache), strict=True):
        assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)
    again = cache.acquire_sync("base", doc)  # a prefix of a cached entry: a hit, nothing computed
    assert again.hit and again.computed_tokens == 0 and again.tokens == len(doc)
    for lease in (a, b, fresh, again):
        lease.release()


def test_extending_a_cached_prefix_leaves_its_entry_untouched(registry, mapstore):
    # a chat turn extends the document's entry exactly at its end: the document's lease must still hold the document
    cache = _family_cache(registry, mapstore)
    doc = _ids(registry, data_text("gpl-3.txt")[:250])
    turn = _ids(registry, " Question one: what is it about?")
    with cache.acquire_sync("base", doc) as held:
        keys = [k.clone() for k, _ in cache_layers(held.cache)]
        with cache.acquire_sync("base", doc + turn) as longer:
            assert longer.reused_tokens == len(doc) and cache_length(longer.cache) == len(doc) + len(turn)
        assert cache_length(held.cache) == len(doc)
        assert all(torch.equal(k0, k1) for k0, (k1, _) in zip(keys, cache_layers(held.cache), strict=True))
        with cache.acquire_sync("base", doc) as again:
            assert again.hit and cache_length(again.cache) == len(doc)


def test_prefix_on_one_member_serves_another_through_a_map(registry, mapstore):
    cache = _family_cache(registry, mapstore)
    doc = _ids(registry, data_text("gpl-3.txt")[:250])
    question = _ids(registry, " What does the licence allow?")
    with cache.acquire_sync("base", doc) as src:
        assert src.path == "exact"
        steps = []
        lease = cache.acquire_sync("child", doc + question, on_step=steps.append)
    assert lease.path == "mapped" and lease.source == "base" and lease.mapping
    kinds = [s.step for s in steps]
    assert "map" in kinds and kinds.index("map") < kinds.index("gate")
    mapped_step = next(s for s in steps if s.step == "map")
    assert mapped_step.tokens == len(doc) and mapped_step.source == "base"
    # the question ran exactly on the target over the mapped document
    tail = next(s for s in steps if s.step == "prefill")
    assert tail.tokens == len(question) and tail.reused_tokens == len(doc)
    assert mapped_step.detail.exact_sinks == 4  # the policy's default: the first positions are the target's own
    assert lease.reused_tokens == len(doc) - lease.tail_tokens - 4 and lease.gates and all(g.passed for g in lease.gates)
    assert lease.tokens == len(doc) + len(question)
    with cache.acquire_sync("child", doc + question, reuse=False) as own:  # the target's own prefill
        for (k, v), (ok, ov) in zip(cache_layers(lease.cache), cache_layers(own.cache), strict=True):
            torch.testing.assert_close(k[:, :, :4], ok[:, :, :4], atol=1e-4, rtol=1e-3)
            torch.testing.assert_close(v[:, :, :4], ov[:, :, :4], atol=1e-4, rtol=1e-3)
    # asking again reuses the mapped entry: no new map
    steps.clear()
    with cache.acquire_sync("child", doc + question, on_step=steps.append) as again:
        assert again.path == "mapped" and again.hit and "map" not in [s.step for s in steps]
    lease.release()


def test_failed_gate_reprefills_on_the_target(registry, mapstore):
    strict = GatePolicy.model_validate({"offline": None, "probe": {"tokens": 16, "max_excess_nll": -100.0}})
    cache = _family_cache(registry, mapstore)
    doc = _ids(registry, data_text("mpl-2.0.txt")[:250])
    cache.acquire_sync("base", doc).release()
    lease = cache.acquire_sync("child", doc, gate=strict)
    assert lease.path == "reprefilled" and "probe gate failed" in lease.fallback_reason
    assert lease.gates and not lease.gates[0].passed and lease.source == "base"
    lease.release()


def test_offline_gate_refuses_before_the_map(registry, mapstore):
    """A manifest the offline gate refuses falls back without mapping, repairing or probing first."""
    strict = GatePolicy.model_validate({"offline": {"max_kl": 1e-9}, "probe": {"tokens": 16, "max_excess_nll": 100.0}})
    cache = _family_cache(registry, mapstore)
    doc = _ids(registry, data_text("mpl-2.0.txt")[:250])
    cache.acquire_sync("base", doc).release()
    counter = TokenCounter(registry.load("base").model)  # the source's tail logits would be computed for a probe
    steps = []
    try:
        lease = cache.acquire_sync("child", doc, gate=strict, on_step=steps.append)
    finally:
        counter.remove()
    assert lease.path == "reprefilled" and lease.fallback_reason.startswith("offline gate failed: held-out KL")
    assert [(g.gate, g.passed) for g in lease.gates] == [("offline", False)]
    assert "heldout_kl" in lease.gates[0].metrics and lease.source == "base"
    kinds = [s.step for s in steps]
    assert "map" not in kinds and "repair" not in kinds and kinds.index("gate") < kinds.index("prefill")
    assert counter.tokens == []
    lease.release()


def test_a_gate_decided_after_use_keeps_a_passing_mapped_lease_and_swaps_a_refused_one_for_the_own_prefill(
        registry, mapstore):
    """`settle`: the answer gate decides only after an agent decoded on the mapped cache. A pass keeps the lease
    with the decision among its gates; a refusal unpins the mapped entry and hands out the member's own prefill,
    a `reprefilled` lease naming the refusal, with a gate step and then a fallback step."""
    from orchestra.familycache.gates import GateDecision

    cache = _family_cache(registry, mapstore)
    doc = _ids(registry, data_text("gpl-3.txt")[300:600])
    cache.acquire_sync("base", doc).release()
    mapped = cache.acquire_sync("child", doc)
    assert mapped.path == "mapped"
    before = list(mapped.gates)
    steps: list = []
    kept = cache.settle_sync(mapped, GateDecision(True, "answer", "F1 1.00 >= 0.5", {"answer_f1": 1.0}), doc,
                             on_step=steps.append)
    assert kept is mapped and kept.path == "mapped" and kept.gates[:-1] == before
    assert (kept.gates[-1].gate, kept.gates[-1].passed) == ("answer", True)
    assert [(s.step, s.passed) for s in steps] == [("gate", True)] and steps[0].metrics == {"answer_f1": 1.0}

    steps.clear()
    entry = next(e for e in cache.pool.entries() if e.id == mapped.entry_id)
    own = cache.settle_sync(mapped, GateDecision(False, "answer", "F1 0.20 < 0.5", {"answer_f1": 0.2}), doc,
                            on_step=steps.append)
    assert own.path == "reprefilled" and own.fallback_reason == "answer gate failed: F1 0.20 < 0.5"
    assert own.source == "base" and own.computed_tokens == len(doc) and own.entry_id != mapped.entry_id
    assert [(g.gate, g.passed) for g in own.gates][-2:] == [("answer", True), ("answer", False)]
    kinds = [s.step for s in steps]
    assert kinds[0] == "gate" and "fallback" in kinds and "map" not in kinds
    assert next(s for s in steps if s.step == "fallback").reason == own.fallback_reason
    assert entry.pins == 0  # the refused mapped entry is no longer held
    with cache.acquire_sync("child", doc, allow_mapped=False) as again:  # the own prefill is now cached
        assert again.hit and again.entry_id == own.entry_id
    with pytest.raises(ValueError, match="only a mapped lease"):
        cache.settle_sync(own, GateDecision(False, "answer", "x"), doc)
    own.release()


def test_concurrent_requests_for_one_prefix_build_it_once(registry, mapstore):
    cache = _family_cache(registry, mapstore)
    doc = _ids(registry, data_text("apache-2.0.txt")[:250])
    counter = TokenCounter(registry.load("base").model, delay=0.2)  # widen the window where both are in flight
    barrier = threading.Barrier(2)
    leases = []

    def ask():
        barrier.wait()
        leases.append(cache.acquire_sync("base", doc))

    try:
        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        counter.remove()
    assert counter.tokens == [len(doc)]  # one prefill between the two requests
    assert len(leases) == 2 and leases[0].entry_id == leases[1].entry_id
    assert sorted(lease.computed_tokens for lease in leases) == [0, len(doc)]
    for lease in leases:
        lease.release()


def test_byte_budget_counts_tail_logits(registry, mapstore):
    from orchestra.familycache._ops import nbytes_of

    doc = _ids(registry, data_text("gpl-3.txt")[:200])
    probe = FamilyCache(registry, mapstore, source="base")
    with probe.acquire_sync("base", doc) as lease:
        kv_only = nbytes_of(lease.cache)
        entry = probe.pool.entries()[0]
        assert entry.tail_logits is not None and entry.nbytes == kv_only + entry.tail_logits.numel() * 4
    budget = int(entry.nbytes * 2.5)  # room for two entries, not three
    cache = _family_cache(registry, mapstore, budget_bytes=budget)
    texts = [data_text(name)[:200] for name in ("gpl-3.txt", "mpl-2.0.txt", "apache-2.0.txt", "gfdl-1.3.txt")]
    for text in texts:
        with cache.acquire_sync("base", _ids(registry, text)):
            pass
        assert cache.used_bytes <= budget
    assert len(cache.pool) == 2 and cache.stats.evictions == 2
    held = [cache.acquire_sync("base", _ids(registry, text)) for text in texts[:3]]  # pinned beyond the budget
    assert all(lease.cache is not None for lease in held) and cache.stats.rejected >= 1
    for lease in held:
        lease.release()
    assert cache.used_bytes <= budget


def test_two_agents_on_one_model_never_run_forward_passes_at_once(fam, mapstore):
    import anyio

    from orchestra.pipelines.spec import PipelineSpec
    from orchestra.runs.scheduler import Orchestra

    def agent(name):
        return {"name": name, "model": "base", "spec": {"task": f"Say {name}.",
                                                       "generation": {"max_new_tokens": 6, "temperature": 0.0}}}

    pipe = PipelineSpec.model_validate({
        "name": "locks", "models": {"base": str(fam.parent), "child": str(fam.child)}, "source": "base",
        "default_device": "cpu", "max_concurrency_per_device": 3, "gate": PERMISSIVE.model_dump(),
        "agents": [agent("a"), agent("b"), {**agent("c"), "model": "child"}],
    })
    orch = Orchestra(pipe, mappings=mapstore)
    counter = TokenCounter(orch.registry.load("base").model, delay=0.005)
    try:
        report = anyio.run(orch.run, data_text("gpl-3.txt")[:200])
    finally:
        counter.remove()
    assert report.succeeded == ["a", "b", "c"]
    assert len(counter.tokens) > 10 and counter.most == 1


def test_concurrent_requests_with_different_questions_prefill_the_document_once(registry, mapstore):
    """Two questions about one document at once, on one member and on another: one document prefill."""
    cache = _family_cache(registry, mapstore)
    doc = _ids(registry, data_text("gfdl-1.3.txt")[:250])
    asks = [("base", doc + _ids(registry, " First question?")), ("base", doc + _ids(registry, " Other one!")),
            ("child", doc + _ids(registry, " And on the child?"))]
    counter = TokenCounter(registry.load("base").model, delay=0.3)  # the first prefill is still running when the others ask
    leases = {}
    started = threading.Event()

    def ask(i, member, ids):
        if i:
            started.wait()
            time.sleep(0.05)
        else:
            started.set()
        leases[i] = cache.acquire_sync(member, ids)

    try:
        threads = [threading.Thread(target=ask, args=(i, m, ids)) for i, (m, ids) in enumerate(asks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        counter.remove()
    base_tokens = [t for t in counter.tokens if t != 512]  # 512: the mapping store's probe reference windows
    assert base_tokens[0] == len(asks[0][1])  # the document, once, with the first question
    assert sum(base_tokens[1:]) < len(doc) // 2  # the second question only computes its own tokens
    assert leases[1].reused_tokens >= len(doc) and leases[1].path == "exact"
    assert leases[2].path == "mapped" and leases[2].source == "base"
    assert any(s.step == "join" for s in leases[1].steps) and any(s.step == "join" for s in leases[2].steps)
    for lease in leases.values():
        lease.release()


def test_repair_budgets_are_priced_in_the_targets_timed_passes(registry, mapstore):
    """The default CachePolicy prices a repair in the target's measured pass seconds: the timings are taken
    once, stored beside the mappings, and the repair summary says which measure priced its plan."""
    from mappings.passcost import PassCosts
    from mappings.repair import RepairPolicy

    doc = _ids(registry, data_text("gpl-3.txt")[:1200])[:400]
    costs_dir = mapstore.directory / "pass-costs"
    for costs in ("measured", "compute"):
        cache = _family_cache(registry, mapstore, repair=RepairPolicy(budget=0.9), repair_costs=costs)
        cache.acquire_sync("base", doc).release()
        steps = []
        with cache.acquire_sync("child", doc, on_step=steps.append) as lease:
            assert lease.path == "mapped"
        repair = next(s for s in steps if s.step == "repair").detail
        assert repair.costs == costs and repair.exact == 4  # the sinks: exact already, paid, not redone
        assert 0 < repair.cost <= 0.9 + 1e-9
        if costs == "measured":  # timed on the child, kept for its architecture
            from mappings.passcost import costs_key

            key = costs_key(registry.load("child").model)
            stored = list(costs_dir.glob(f"{key['architecture'][:16]}-*.json"))
            # measured_on: the child, or a model of its shape timed earlier in this process
            assert len(stored) == 1 and PassCosts.load(stored[0], key).measured_on


def test_a_map_fitted_without_its_sinks_is_served_with_them(registry, mapstore):
    """sink_tokens=0 asks for the pure map, but a map whose method left the first positions out of its fit
    (anchored_kl's exact_sinks) is only good with them exact: the cache makes them exact anyway."""
    cache = _family_cache(registry, mapstore, sink_tokens=0)
    doc = _ids(registry, data_text("gpl-3.txt")[:900])[:200]
    cache.acquire_sync("base", doc).release()
    steps = []
    with cache.acquire_sync("child", doc, on_step=steps.append) as lease:
        assert lease.path == "mapped"
        mapping = cache.load_mapping("base", "child")
    assert mapping.manifest.method.exact_sinks == 4
    assert next(s for s in steps if s.step == "map").detail.exact_sinks == 4


def _burst(cache, asks, *, first=None):
    """Acquire every (member, ids) at once (after `first` has started building, when given); their leases."""
    leases, errors = {}, []
    barrier = threading.Barrier(len(asks))

    def ask(i, member, ids):
        try:
            barrier.wait()
            leases[i] = cache.acquire_sync(member, ids)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i, m, ids)) for i, (m, ids) in enumerate(asks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return [leases[i] for i in range(len(asks))]


def _builds(leases):
    steps = [s for lease in leases for s in lease.steps]
    return [(s.step, s.member) for s in steps if s.step in ("prefill", "map")]


def test_a_cold_burst_over_one_document_prefills_it_once_and_maps_it_once(registry, mapstore):
    """Three requests on the source and three on the child, all cold, all at once: the source prefills the
    document, its other requests wait for that build, the child's wait for it too and map it once between them."""
    cache = _family_cache(registry, mapstore)
    cache.load_mapping("base", "child")  # loaded (or calibrated) before the burst: this test times the routing
    doc = _ids(registry, data_text("gpl-3.txt")[:300])
    started, release = threading.Event(), threading.Event()

    def hold(*_args):  # the prefill waits until every other request has joined it: no race against a sleep
        started.set()
        release.wait(60)

    mapped = threading.Event()

    def hold_map(*_args):  # and the map waits for the other two child requests, however late a loaded machine
        if not mapped.is_set():  # wakes them: none of them may find the map already built (a hit, not a join)
            wait_until(lambda: cache.stats.waiting >= 2, what="two child requests joining the map")
            mapped.set()

    hook = registry.load("base").model.register_forward_pre_hook(hold)
    child_hook = registry.load("child").model.register_forward_pre_hook(hold_map)
    first: dict[str, object] = {}
    burst: dict[str, list] = {}
    try:
        opener = threading.Thread(target=lambda: first.setdefault("lease", cache.acquire_sync("base", doc)))
        opener.start()
        wait_until(started.is_set, what="the first build to start", alive=opener)
        rest_thread = threading.Thread(
            target=lambda: burst.setdefault("leases", _burst(cache, [("base", doc)] * 2 + [("child", doc)] * 3)))
        rest_thread.start()
        wait_until(lambda: cache.stats.waiting >= 5, what="five requests joining the build", alive=rest_thread)
        joined_while_building = cache.stats.waiting
        release.set()
        rest_thread.join()
        opener.join()
    finally:
        release.set()
        hook.remove()
        child_hook.remove()
    rest = burst["leases"]
    assert joined_while_building == 5  # two source requests and three child requests waited on the one prefill
    leases = [first["lease"], *rest]
    assert _builds(leases) == [("prefill", "base"), ("map", "child")]
    assert [lease.path for lease in leases] == ["exact"] * 3 + ["mapped"] * 3
    assert len({lease.entry_id for lease in leases[3:]}) == 1  # the three child leases share one mapped entry
    assert all(any(s.step == "join" for s in lease.steps) for lease in leases[1:])
    assert cache.stats.joins == 5 and cache.stats.hits == 0 and cache.stats.waiting == 0
    for lease in leases:
        lease.release()


def test_a_cold_burst_started_at_once_builds_the_document_once_and_maps_it_once(registry, mapstore):
    """Whoever asks first: the child's cold request seeds the document on the source, so the source's own
    requests join that build and the child's map it; planning and registering a build are one step."""
    cache = _family_cache(registry, mapstore)
    cache.load_mapping("base", "child")
    doc = _ids(registry, data_text("mpl-2.0.txt")[:300])
    counter = TokenCounter(registry.load("base").model, delay=0.2)
    try:
        leases = _burst(cache, [("base", doc), ("child", doc)] * 3)
    finally:
        counter.remove()
    assert _builds(leases) == [("prefill", "base"), ("map", "child")]
    assert [lease.path for lease in leases] == ["exact", "mapped"] * 3
    for lease in leases:
        lease.release()


def test_a_cold_request_on_a_mapped_member_is_built_on_the_source_and_mapped(registry, mapstore):
    cache = _family_cache(registry, mapstore)
    cache.load_mapping("base", "child")
    doc = _ids(registry, data_text("gpl-3.txt")[300:600])
    with cache.acquire_sync("child", doc) as lease:
        assert lease.path == "mapped" and lease.source == "base"
        assert [(s.step, s.member) for s in lease.steps if s.step in ("prefill", "map")][:2] == [
            ("prefill", "base"), ("map", "child")]
        assert lease.prefill_seconds > 0
    with cache.acquire_sync("base", doc) as again:  # the seed serves the source itself
        assert again.path == "exact" and again.hit


def test_seeding_off_prefills_a_cold_request_on_its_own_member(registry, mapstore):
    cache = _family_cache(registry, mapstore, seed_source=False)
    cache.load_mapping("base", "child")
    doc = _ids(registry, data_text("gpl-3.txt")[600:900])
    with cache.acquire_sync("child", doc) as lease:
        assert lease.path == "exact"
        assert [(s.step, s.member) for s in lease.steps if s.step in ("prefill", "map")] == [("prefill", "child")]


def test_a_build_holds_its_k_v_and_working_memory_against_the_budget_until_it_becomes_an_entry(registry, mapstore):
    """While a build runs, the budget counts the entry it will leave and its forward pass's working memory
    (`BUILD_MEMORY_FACTOR`) over the tokens it computes: a prefill over all of them, an extension over its new
    ones only. Per token from the model's shape before any entry exists, then from the first entry's K/V."""
    from mappings.capture import kv_token_bytes
    from orchestra.familycache._flights import BUILD_MEMORY_FACTOR

    cache = _family_cache(registry, mapstore)
    doc = _ids(registry, data_text("gpl-3.txt")[:300])
    longer = doc + _ids(registry, " The next paragraph follows the first one here.")
    seen: list[int] = []
    hook = registry.load("base").model.register_forward_pre_hook(lambda *_: seen.append(cache.pool.reserved_bytes))
    try:
        with cache.acquire_sync("base", doc):
            pass
        first = list(seen)
        seen.clear()
        with cache.acquire_sync("base", longer) as lease:
            assert lease.reused_tokens == len(doc)  # an extension of the first entry
    finally:
        hook.remove()
    per_token = kv_token_bytes(registry.info("base").config, 4)  # the tiny family's K/V is float32
    extra = BUILD_MEMORY_FACTOR - 1
    assert first and first[0] == int(per_token * (len(doc) + extra * len(doc)))
    new = len(longer) - len(doc)
    assert seen and seen[0] == int(per_token * (len(longer) + extra * new))
    assert cache.pool.reserved_bytes == 0 and cache.pool.used_bytes >= per_token * (len(doc) + len(longer))
