"""The disk tier: a FamilyCache in another process (or a fresh one here) reads what an earlier one built."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mappings import cache_layers
from orchestra.family.corpus import data_text
from orchestra.familycache import CachePolicy, FamilyCache, KVStore, Namespace
from orchestra.familycache.gates import GatePolicy
from orchestra.models.registry import ModelRegistry
from tests.orchestra.familycache.test_core import TokenCounter
from tests.waiting import HANG_GUARD_S

PERMISSIVE = GatePolicy.model_validate({"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0,
                                                                   "max_excess_kl": 100.0}})


@pytest.fixture(scope="module")
def registry(fam):
    return ModelRegistry({"base": str(fam.parent), "child": str(fam.child)}, default_device="cpu")


def _cache(registry, mapstore, disk: KVStore) -> FamilyCache:
    return FamilyCache(registry, mapstore, source="base", disk=disk,
                       policy=CachePolicy(gate=PERMISSIVE, min_mapped_tokens=16))


def _doc(registry, chars: int = 600) -> list[int]:
    return registry.load("base").tokenizer(data_text("gpl-3.txt")[:chars], add_special_tokens=False)["input_ids"]


def _same(a, b) -> None:
    for (k, v), (ok, ov) in zip(cache_layers(a), cache_layers(b), strict=True):
        assert torch.equal(k, ok) and torch.equal(v, ov)


def test_a_new_cache_reads_the_document_from_disk_instead_of_prefilling(registry, mapstore, tmp_path):
    doc = _doc(registry)
    first = _cache(registry, mapstore, KVStore(tmp_path))
    with first.acquire_sync("base", doc) as built:
        assert built.loaded_tokens == 0 and built.computed_tokens == len(doc)
        assert first.flush(30)
        later = _cache(registry, mapstore, KVStore(tmp_path))  # a later process: an empty memory tier
        counter = TokenCounter(registry.load("base").model)
        steps = []
        try:
            lease = later.acquire_sync("base", doc, on_step=steps.append)
        finally:
            counter.remove()
        assert counter.tokens == []  # not one position computed
        assert lease.path == "exact" and lease.loaded_tokens == len(doc) and lease.load_seconds > 0
        assert [s.step for s in steps] == ["load", "hit"] and steps[0].entry_kind == "exact"
        assert lease.saved_seconds > 0 and later.prefill_estimate("base", len(doc)) > 0
        _same(lease.cache, built.cache)
        lease.release()
    # a longer request reads the stored prefix and computes only its own tokens
    question = registry.load("base").tokenizer(" What may a licensee do?", add_special_tokens=False)["input_ids"]
    again = _cache(registry, mapstore, KVStore(tmp_path))
    with again.acquire_sync("base", doc + question) as lease:
        assert lease.loaded_tokens == len(doc) and lease.computed_tokens == len(question)


def test_a_mapped_entry_read_from_disk_stays_mapped_and_passes_its_gates(registry, mapstore, tmp_path):
    doc = _doc(registry)
    first = _cache(registry, mapstore, KVStore(tmp_path))
    with first.acquire_sync("base", doc), first.acquire_sync("child", doc) as mapped:
        assert mapped.path == "mapped"
        first.flush(30)
        later = _cache(registry, mapstore, KVStore(tmp_path))
        steps = []
        lease = later.acquire_sync("child", doc, on_step=steps.append)
        kinds = [s.step for s in steps]
        assert lease.path == "mapped" and lease.source == "base" and "map" not in kinds and "prefill" not in kinds
        assert steps[0].step == "load" and steps[0].entry_kind == "mapped"
        assert lease.gates and all(g.passed for g in lease.gates)  # its probe reading, read back, decided again
        _same(lease.cache, mapped.cache)
        lease.release()
        # an exact request on the member never gets the mapped entry: it finds none of its own on disk
        steps.clear()
        with later.acquire_sync("child", doc, allow_mapped=False, on_step=steps.append) as own:
            assert own.path == "exact" and own.loaded_tokens == 0 and own.computed_tokens == len(doc)
            assert "load" not in [s.step for s in steps]


def test_a_mapped_entry_of_a_replaced_mapping_is_deleted_not_served(registry, mapstore, tmp_path):
    doc = _doc(registry)
    store = KVStore(tmp_path)
    first = _cache(registry, mapstore, store)
    with first.acquire_sync("base", doc), first.acquire_sync("child", doc):
        first.flush(30)
    mapped = [e for e in store.entries() if e.namespace.kind == "mapped"]
    assert len(mapped) == 1
    good = mapped[0]
    loaded = store.load(good)
    assert loaded is not None
    stale = replace(good.namespace, mapping_id="0" * 64)  # what a since-recalibrated mapping had made
    store.put(stale, "child", good.tokens, loaded.layers, tail_logits=loaded.tail_logits,
              logits_end=loaded.logits_end, mapped={**(loaded.mapped or {}), "mapping_id": "0" * 64})
    store.remove(good)
    store.flush()
    assert [e.namespace.mapping_id for e in store.entries() if e.namespace.kind == "mapped"] == ["0" * 64]
    later = _cache(registry, mapstore, KVStore(tmp_path))
    steps = []
    with later.acquire_sync("child", doc, on_step=steps.append) as lease:
        assert lease.path == "mapped" and "map" in [s.step for s in steps]  # mapped afresh from base's disk entry
        assert not any(s.step == "load" and s.entry_kind == "mapped" for s in steps)
    assert all(e.namespace.mapping_id != "0" * 64 for e in KVStore(tmp_path).entries())


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_damaged_file_is_deleted_and_recomputed_never_served(registry, mapstore, tmp_path, damage):
    doc = _doc(registry)
    first = _cache(registry, mapstore, KVStore(tmp_path))
    with first.acquire_sync("base", doc) as built:
        reference = [(k.clone(), v.clone()) for k, v in cache_layers(built.cache)]
        first.flush(30)
    (stored,) = KVStore(tmp_path).entries()
    data = bytearray(stored.path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 1000]
    else:
        data[-500] ^= 0xFF
    stored.path.write_bytes(bytes(data))
    store = KVStore(tmp_path)
    later = _cache(registry, mapstore, store)
    steps = []
    with later.acquire_sync("base", doc, on_step=steps.append) as lease:
        assert lease.loaded_tokens == 0 and lease.computed_tokens == len(doc)
        assert store.stats.corrupt == 1
        for (k, v), (rk, rv) in zip(cache_layers(lease.cache), reference, strict=True):
            torch.testing.assert_close(k, rk)
            torch.testing.assert_close(v, rv)
    later.flush(30)
    (rewritten,) = KVStore(tmp_path).entries()  # the damaged file was replaced by the recomputed cache
    assert KVStore(tmp_path).load(rewritten) is not None


def _tensors(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)) for _ in range(2)]


NS = Namespace("exact", "f" * 16, "float32", "{}")


def test_a_near_duplicate_is_not_written_and_the_budget_evicts_the_least_recently_used(tmp_path):
    store = KVStore(tmp_path, budget_bytes=10 << 20, min_tokens=8, min_new_tokens=32)
    a, b = list(range(100)), list(range(1000, 1100))
    store.put(NS, "m", a, _tensors(100, 0))
    store.put(NS, "m", a + [7] * 10, _tensors(110, 1))  # ten new tokens over a stored prefix: not worth a file
    store.put(NS, "m", b, _tensors(100, 2))
    store.flush()
    assert store.stats.skipped == 1 and sorted(len(e.tokens) for e in store.entries()) == [100, 100]
    size = store.entries()[0].nbytes
    first = store.find(NS, a)[0]
    assert first is not None and store.load(first) is not None  # a read makes `a` the most recently used
    small = KVStore(tmp_path, budget_bytes=2 * size + size // 2, min_tokens=8)
    small.put(NS, "m", list(range(5000, 5100)), _tensors(100, 3))
    small.flush()
    kept = {e.tokens[0] for e in small.entries()}
    assert kept == {0, 5000}  # b, the least recently used, went


def test_a_store_that_cannot_be_written_warns_and_still_serves_from_memory(registry, mapstore, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = KVStore(blocker / "kv")
    assert not store.writable and "cannot be written" in store.warnings[0]
    cache = _cache(registry, mapstore, store)
    doc = _doc(registry, 300)
    with cache.acquire_sync("base", doc) as lease:
        assert lease.computed_tokens == len(doc)
    with cache.acquire_sync("base", doc) as again:
        assert again.hit
    assert store.flush(5) and store.entries() == []


WRITER = textwrap.dedent("""
    import sys, torch
    from orchestra.familycache import KVStore, Namespace
    store = KVStore(sys.argv[1], min_tokens=8, min_new_tokens=0)
    ns = Namespace("exact", "f" * 16, "float32", "{}")
    for i in range(12):
        g = torch.Generator().manual_seed(i)
        layers = [(torch.randn(1, 2, 256, 16, generator=g), torch.randn(1, 2, 256, 16, generator=g))] * 4
        store.put(ns, sys.argv[2], list(range(i * 1000, i * 1000 + 256)), layers)
    store.close()
""")


def test_two_processes_writing_one_store_leave_only_whole_entries(tmp_path):
    root = Path(__file__).resolve().parents[3]
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name], cwd=root) for name in "ab"]
    assert [p.wait(timeout=HANG_GUARD_S) for p in procs] == [0, 0]
    store = KVStore(tmp_path)
    entries = store.entries()
    assert len(entries) == 12  # one file per key, whoever wrote it last
    assert all(store.load(e) is not None for e in entries) and store.stats.corrupt == 0
    assert not list(tmp_path.rglob("*.tmp"))


def _pipeline(fam, mapstore, kv: Path):
    from orchestra import Pipeline

    return (Pipeline("disk", source="base", models={"base": str(fam.parent), "child": str(fam.child)},
                     mapping={"directory": str(mapstore.directory), "on_missing": "calibrate"},
                     default_device="cpu", gate=PERMISSIVE.model_dump())
            .with_kv_store(True, directory=str(kv))
            .agent({"name": "on_base", "task": "Summarise.", "generation": {"max_new_tokens": 4}}, model="base")
            .agent({"name": "on_child", "task": "Summarise.", "generation": {"max_new_tokens": 4}}, model="child"))


def test_a_second_pipeline_reads_every_members_document_cache_from_disk_with_the_same_outputs(fam, mapstore,
                                                                                              tmp_path):
    doc = data_text("gpl-3.txt")[:350]
    first = _pipeline(fam, mapstore, tmp_path / "kv")
    cold = first.run_sync(doc)
    first.close()  # a closed pipeline's caches are on disk
    second = _pipeline(fam, mapstore, tmp_path / "kv")
    warm = second.run_sync(doc)
    second.close()
    assert [a.status for a in cold.agents + warm.agents] == ["succeeded"] * 4
    assert cold.disk_loads == 0 and cold.prefill_s_spent > 0
    paths = {c.model: c.path for c in warm.caches}
    assert paths == {"base": "exact", "child": "mapped"}  # the mapped cache is read back as mapped
    assert all(c.from_disk and c.disk_tokens == warm.document_tokens for c in warm.caches)
    assert warm.prefill_s_spent == 0 and warm.disk_loads >= 2 and warm.disk_load_s > 0
    assert [a.output for a in warm.agents] == [a.output for a in cold.agents]  # greedy: the same answers
    assert warm.agent("on_base").prefill_s_saved > 0


def test_no_kv_store_on_the_command_line_keeps_caches_in_memory(fam, mapstore, tmp_path, monkeypatch):
    from tests.cli_run import run_pipeline_text

    monkeypatch.setenv("ORCHESTRA_KV_STORE", str(tmp_path / "kv"))
    yaml = (f"models: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\n"
            f"mapping: {{directory: '{mapstore.directory}'}}\n"
            "agents:\n  - {name: a, model: base, spec: {task: 'Answer: who may copy it?', generation: {max_new_tokens: 3}}}\n")
    doc = data_text("gpl-3.txt")[:300]
    code, _, out = run_pipeline_text(tmp_path, yaml, doc, "--no-kv-store")
    assert code == 0, out
    assert KVStore(tmp_path / "kv").entries() == []
    code, _, out = run_pipeline_text(tmp_path, yaml, doc, "--report", str(tmp_path / "r.json"))
    assert code == 0, out
    assert len(KVStore(tmp_path / "kv").entries()) == 1


@pytest.mark.parametrize("chars", [300, 800], ids=["whole", "chunked"])
def test_a_document_whose_beginning_a_longer_entry_holds_is_read_whole_from_disk_on_its_next_run(fam, mapstore,
                                                                                                 tmp_path, chars):
    """Excerpts and drafts of one text: after one run of a document, the next run in a new process computes none of
    it, although the store also holds longer and shorter documents that begin the same way (the tiny models' 512
    positions make the 800-character document a chunked run: each chunk is read whole)."""
    import json
    import os

    yaml = (f"models: {{base: '{fam.parent}', child: '{fam.child}'}}\nsource: base\ndefault_device: cpu\n"
            f"mapping: {{directory: '{mapstore.directory}'}}\n"
            f"gate: {json.dumps(PERMISSIVE.model_dump())}\n"
            "agents:\n  - {name: a, model: base, spec: {task: 'Summarise.', generation: {max_new_tokens: 3}}}\n"
            "  - {name: b, model: child, spec: {task: 'Summarise.', generation: {max_new_tokens: 3}}}\n")
    (tmp_path / "p.yaml").write_text(yaml)
    text = data_text("gpl-3.txt")

    def run(chars: int, tag: str) -> dict:
        (tmp_path / f"{tag}.txt").write_text(text[:chars])
        done = subprocess.run([sys.executable, "-m", "orchestra", "run", str(tmp_path / "p.yaml"), "--document",
                               str(tmp_path / f"{tag}.txt"), "--home", str(tmp_path / "home"), "--report",
                               str(tmp_path / f"{tag}.json")],
                              env={**os.environ, "ORCHESTRA_KV_STORE": str(tmp_path / "kv")},
                              cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True,
                              timeout=HANG_GUARD_S)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((tmp_path / f"{tag}.json").read_text())

    run(1100, "longer")
    run(150, "shorter")
    first = run(chars, "first")
    # the stored entries serve most of it, the rest is computed: and now stored, though it adds little
    assert first["prefill_s_spent"] > 0 and any(c["from_disk"] for c in first["caches"])
    second = run(chars, "second")
    assert bool(second["chunks"]) == (chars == 800)
    lengths = [c["tokens"] for c in second["chunks"]] or [second["document_tokens"]]
    for member, path in (("base", "exact"), ("child", "mapped")):
        caches = [c for c in second["caches"] if c["model"] == member]
        assert {c["path"] for c in caches} == {path}
        assert [c["disk_tokens"] for c in caches] == lengths and all(c["from_disk"] for c in caches)
    assert second["prefill_s_spent"] == 0  # not a token of the document computed in this process
