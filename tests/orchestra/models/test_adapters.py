"""LoRA adapters as family members ("Bring your own family", item 3): one copy of the base's weights.

The adapters are real peft LoRA adapters over the tiny llama parent (4 layers), saved with peft's
``save_pretrained`` (safetensors): ``all`` adapts every layer, ``upper`` layers 2-3 only
(``layers_to_transform``), ``top`` layer 3 only; their B factors are random (peft starts them at zero,
which would change nothing), so every adapter's outputs differ from the base's. peft itself is the
reference for what an adapter computes; the runtime applies adapters without it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mappings import cache_layers
from mappings.store import read_manifest
from orchestra.errors import AdapterBaseError, AdapterError, ModelReferenceError, PipelineValidationError
from orchestra.family.corpus import data_text
from orchestra.models.modelref import AdapterSpec
from orchestra.models.registry import ModelRegistry, shared_layers
from orchestra.pipelines.spec import PipelineSpec
from tests.cli_run import run_pipeline_text
from tests.fixtures.adapters import make_lora_adapter

DOC = data_text("gpl-3.txt")[:320]
IDS = torch.tensor([list(range(3, 90))])


def make_adapter(parent: Path, out: Path, layers: list[int] | None, seed: int, rank: int = 4) -> Path:
    """A peft LoRA adapter over `parent` on `layers` (None: all), B factors large enough to move the logits."""
    made = make_lora_adapter(parent, out, layers=layers, rank=rank, scale=0.05, seed=seed)
    assert (made / "adapter_model.safetensors").is_file()
    return made


@pytest.fixture(scope="module")
def lora(fam, tmp_path_factory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("lora")
    return SimpleNamespace(all=make_adapter(fam.parent, d / "all", None, 1),
                           upper=make_adapter(fam.parent, d / "upper", [2, 3], 2),
                           top=make_adapter(fam.parent, d / "top", [3], 3), dir=d)


def _registry(fam, lora, **extra: str | AdapterSpec) -> ModelRegistry:
    return ModelRegistry({"base": str(fam.parent), "all": AdapterSpec(str(lora.all), "base"),
                          "upper": AdapterSpec(str(lora.upper), "base"), **extra}, default_device="cpu")


def _peft_logits(parent: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(parent, dtype=torch.float32)
        return PeftModel.from_pretrained(base, adapter).eval()(IDS).logits


def _storage_bytes(*models: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the models' parameters and buffers (shared ones counted once)."""
    seen: dict[int, int] = {}
    for model in models:
        for t in (*model.parameters(), *model.buffers()):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_an_adapter_member_computes_what_peft_computes(fam, lora):
    registry = _registry(fam, lora)
    with torch.no_grad():
        base = registry.load("base").model(IDS).logits
        for alias, folder in (("all", lora.all), ("upper", lora.upper)):
            mine = registry.load(alias).model(IDS).logits
            assert torch.equal(mine, _peft_logits(fam.parent, folder))  # the same operations as peft's, bit for bit
            assert not torch.allclose(mine, base, atol=1e-2)
        assert torch.equal(registry.load("base").model(IDS).logits, base)  # attaching adapters left the base as it was


def test_base_and_adapters_hold_the_weights_once(fam, lora):
    registry = _registry(fam, lora)
    base, tuned, upper = (registry.load(a) for a in ("base", "all", "upper"))
    base_ptrs = {p.data_ptr() for p in base.model.parameters()}
    for member in (tuned, upper):
        own = [p for p in member.model.parameters() if p.data_ptr() not in base_ptrs]
        assert all("lora_" in name for name, p in member.model.named_parameters() if p.data_ptr() not in base_ptrs)
        assert sum(p.numel() * p.element_size() for p in own) == member.info.adapter.adapter_bytes
        assert member.lock is base.lock and member.device == base.device
        assert member.model is not base.model and member.model.model.layers[0] is not base.model.model.layers[0]
    alone = _storage_bytes(base.model)
    together = _storage_bytes(base.model, tuned.model, upper.model)
    added = tuned.info.adapter.adapter_bytes + upper.info.adapter.adapter_bytes
    assert together == alone + added and added < alone / 4  # r=4 on every projection of a 64-wide model
    # what an adapter adds to a pass's work (weights read) vs. the memory it adds
    assert tuned.info.weight_bytes > base.info.weight_bytes
    assert registry._reserved["cpu"] < 1.2 * (base.info.weight_bytes + added)


def test_fingerprints_are_per_adapter_and_stable(fam, lora, tmp_path):
    one, two = _registry(fam, lora), _registry(fam, lora)
    aliases = ("base", "all", "upper")
    fps = {a: one.info(a).fingerprint for a in aliases}
    assert len(set(fps.values())) == 3
    assert fps == {a: two.info(a).fingerprint for a in aliases}
    base, tuned = one.info("base").fingerprint_parts, one.info("all").fingerprint_parts
    assert tuned["config"] == base["config"] and tuned["tokenizer"] == base["tokenizer"]
    assert tuned["weights"] != base["weights"]
    assert one.info("all").tokenizer_digest == one.info("base").tokenizer_digest
    # content, not location: a copied adapter folder is the same member; the same adapter on another base is not
    copied = shutil.copytree(lora.upper, tmp_path / "elsewhere")
    other = ModelRegistry({"base": str(fam.parent), "child": str(fam.child), "u": AdapterSpec(str(copied), "base"),
                           "on_child": AdapterSpec(str(lora.upper), "child")}, default_device="cpu")
    assert other.info("u").fingerprint == fps["upper"]
    assert other.info("on_child").fingerprint not in fps.values()
    # a mapping calibrated from a member records the fingerprint the registry looks it up by
    assert one.load("upper").handle().fingerprint.as_dict() == one.info("upper").fingerprint_parts


def test_untouched_lower_layers_are_read_from_the_adapter(fam, lora):
    registry = _registry(fam, lora, top=AdapterSpec(str(lora.top), "base"))
    base, tuned, upper, top = (registry.info(a) for a in ("base", "all", "upper", "top"))
    assert (tuned.adapter.untouched_layers, upper.adapter.untouched_layers, top.adapter.untouched_layers) == (0, 2, 3)
    assert shared_layers(base, upper) == shared_layers(upper, base) == 2
    assert shared_layers(upper, top) == 2 and shared_layers(base, top) == 3 and shared_layers(tuned, upper) == 0
    child = ModelRegistry({"child": str(fam.child)}, default_device="cpu").info("child")
    assert shared_layers(child, upper) == 0  # another base: nothing is known to be equal


async def test_a_pipeline_prefills_once_and_maps_into_its_adapters(fam, lora, mapstore):
    from orchestra.runs.scheduler import Orchestra

    pipe = PipelineSpec.model_validate({
        "name": "lora", "source": "base", "default_device": "cpu",
        "models": {"base": str(fam.parent), "all": {"adapter": str(lora.all), "base": "base"},
                   "upper": {"adapter": str(lora.upper), "base": "base"}},
        "gate": {"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0}},
        "agents": [_agent("a", "base"), _agent("b", "all"), _agent("c", "upper")],
    })
    orch = Orchestra(pipe, mappings=mapstore)
    report = await orch.run(DOC)
    assert report.succeeded == ["a", "b", "c"]
    assert {r.name: r.cache_path for r in report.agents} == {"a": "exact", "b": "mapped", "c": "mapped"}
    prefilled = [c for c in report.caches if c.path in {"exact", "reprefilled"}]
    assert len(prefilled) == 1 and prefilled[0].model == "base"  # the document was prefilled once, on the base

    registry = orch.registry
    base, upper = registry.info("base"), registry.info("upper")
    assert read_manifest(mapstore.path_for(base, upper)).exact_layers == 2
    assert read_manifest(mapstore.path_for(base, registry.info("all"))).exact_layers == 0
    entries = list(orch.cache.pool.entries())
    mapped = next(e for e in entries if e.member == "upper" and e.namespace.kind == "mapped")
    assert mapped.mapped is not None
    lo, hi = mapped.mapped.exact_sinks, mapped.mapped.mapped_tokens - mapped.mapped.tail
    source = next(e for e in entries if e.member == "base" and e.namespace.kind == "exact"
                  and e.tokens[:hi] == mapped.tokens[:hi])
    assert hi - lo > 32
    for i, ((k, v), (bk, bv)) in enumerate(zip(cache_layers(mapped.cache), cache_layers(source.cache), strict=True)):
        span = (..., slice(lo, hi), slice(None))
        if i < 2:  # the layers the adapter leaves alone: the base's K/V, bit for bit
            assert torch.equal(k[span], bk[span]) and torch.equal(v[span], bv[span])
            assert torch.allclose(k[..., :hi, :], bk[..., :hi, :], atol=1e-5)  # sinks recomputed: the same values
        else:
            assert not torch.equal(v[span], bv[span])


def test_an_adapter_maps_into_another_adapter_with_exact_shared_layers(fam, lora, mapstore):
    from mappings.apply import map_cache
    from mappings.cache_io import forward_with_cache

    registry = _registry(fam, lora, top=AdapterSpec(str(lora.top), "base"))
    upper, top = registry.load("upper"), registry.load("top")
    mapping, _ = mapstore.get(upper, top)
    assert mapping.manifest.exact_layers == 2
    assert [e.mode for e in mapping.manifest.layer_plan][:2] == ["passthrough", "passthrough"]
    with torch.no_grad():
        _, upper_cache, _ = forward_with_cache(upper.model, IDS, None)
        _, top_cache, _ = forward_with_cache(top.model, IDS, None)
        mapped = cache_layers(map_cache(mapping.kv_map, upper_cache, top.model))
    for i in range(2):
        assert torch.equal(mapped[i][0], cache_layers(top_cache)[i][0])
        assert torch.equal(mapped[i][1], cache_layers(top_cache)[i][1])


def test_v1_manifests_still_load_and_exact_layers_are_checked(fam, lora, mapstore, tmp_path):
    from mappings.errors import CorruptMappingError
    from mappings.manifest import MAPPING_VERSION
    from mappings.store import load_mapping

    registry = _registry(fam, lora)
    base, upper = registry.load("base"), registry.load("upper")
    mapping, _ = mapstore.get(base, upper)
    assert mapping.manifest.mapping_version == MAPPING_VERSION == 2
    old = shutil.copytree(mapstore.path_for(base, upper), tmp_path / "v1")
    data = json.loads((old / "manifest.json").read_text())
    bad = {**data, "layer_plan": [{**e, "mode": "map", "alpha": 1.0} if e["target_layer"] == 0 else e
                                  for e in data["layer_plan"]]}
    del data["exact_layers"]
    (old / "manifest.json").write_text(json.dumps({**data, "mapping_version": 1}))
    loaded = load_mapping(old, base.info.fingerprint, upper.info.fingerprint)
    assert loaded.manifest.mapping_version == 1 and loaded.manifest.exact_layers == 0
    (old / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(CorruptMappingError, match="exact layer 0 is not a pass-through"):
        load_mapping(old, base.info.fingerprint, upper.info.fingerprint)


def test_a_plain_adapter_folder_finds_its_declared_base(fam, lora):
    registry = ModelRegistry({"parent": str(fam.parent), "tuned": str(lora.all)}, default_device="cpu")
    assert registry.info("tuned").adapter.base_alias == "parent"  # its base_model_name_or_path is that folder
    assert registry.info("tuned").fingerprint == _registry(fam, lora).info("all").fingerprint


def test_a_hub_adapter_is_read_from_the_hub_cache_offline(fam, lora, tmp_path, monkeypatch):
    from orchestra.errors import ModelNotCachedError
    from tests.fixtures.hubcache import hub_repo

    snap = hub_repo(tmp_path / "hub", "tiny/lora-upper", lora.upper)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    registry = _registry(fam, lora, hub=AdapterSpec("tiny/lora-upper", "base"),
                         absent=AdapterSpec("tiny/no-such-lora", "base"))
    info = registry.info("hub")
    assert info.path == snap and info.name == "tiny--lora-upper" and info.adapter.untouched_layers == 2
    assert info.fingerprint != registry.info("upper").fingerprint  # tensors named by their blob hash instead
    with torch.no_grad():
        assert torch.equal(registry.load("hub").model(IDS).logits, registry.load("upper").model(IDS).logits)
    with pytest.raises(ModelNotCachedError, match="model 'absent' -> tiny/no-such-lora is not in the Hugging Face"):
        registry.info("absent")


def test_an_adapter_over_an_undeclared_base_is_refused_in_one_line(fam, lora):
    assert issubclass(AdapterBaseError, ModelReferenceError)
    models = {"base": str(fam.parent), "tuned": {"adapter": str(lora.all), "base": "bsae"}}
    with pytest.raises(AdapterBaseError, match="'bsae' is not a declared model.*did you mean 'base'") as info:
        PipelineSpec.model_validate({"models": models, "agents": [_agent("a", "tuned")]})
    assert "\n" not in str(info.value) and "models.tuned" in str(info.value)
    with pytest.raises(AdapterBaseError, match="is an adapter itself"):
        PipelineSpec.model_validate({"models": {**models, "tuned": {"adapter": str(lora.all), "base": "other"},
                                                "other": {"adapter": str(lora.upper), "base": "base"}},
                                     "agents": [_agent("a", "tuned")]})
    from orchestra import Pipeline

    with pytest.raises(AdapterBaseError):
        Pipeline("p", models={"tuned": AdapterSpec(str(lora.all), "ghost")})
    with pytest.raises(PipelineValidationError, match="models.tuned.base"):
        PipelineSpec.model_validate({"models": {"tuned": {"adapter": str(lora.all)}}, "agents": [_agent("a", "tuned")]})
    # an adapter folder given as a plain string, whose base is nowhere in models
    with pytest.raises(AdapterBaseError, match=r"LoRA adapter over '.*parent'.*not a declared model") as info:
        ModelRegistry({"tuned": str(lora.all)}, default_device="cpu").info("tuned")
    assert "\n" not in str(info.value)
    with pytest.raises(AdapterBaseError, match="'gone'"):
        ModelRegistry({"tuned": AdapterSpec(str(lora.all), "gone")}).info("tuned")


def test_orchestra_run_refuses_an_undeclared_base_with_exit_2_and_one_line(fam, lora, tmp_path):
    code, lines, output = run_pipeline_text(
        tmp_path, f"models: {{base: '{fam.parent}', tuned: {{adapter: '{lora.all}', base: nobase}}}}\nsource: base\n"
        "default_device: cpu\nagents:\n  - {name: a, model: tuned, spec: {task: Summarise.}}\n", DOC)
    assert code == 2, output
    assert len(lines) == 1 and "AdapterBaseError" in lines[0] and "'nobase' is not a declared model" in lines[0]
    assert "Traceback" not in output


def test_an_adapter_the_runtime_cannot_apply_is_refused(fam, lora, tmp_path):
    dora = shutil.copytree(lora.upper, tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora.*merge_and_unload"):
        ModelRegistry({"base": str(fam.parent), "d": AdapterSpec(str(dora), "base")}).info("d")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(lora.upper / "adapter_config.json", bare)
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        ModelRegistry({"base": str(fam.parent), "b": AdapterSpec(str(bare), "base")}).info("b")


def test_the_python_builder_takes_adapters_and_keeps_their_base(fam, lora):
    from orchestra import Pipeline

    p = (Pipeline("p", source=None, models={"base": fam.parent, "tuned": {"adapter": str(lora.all), "base": "base"},
                                            "mine": AdapterSpec(str(lora.upper), "base")})
         .agent("summarizer", model="tuned", max_words=20))
    assert p.spec.models["tuned"] == AdapterSpec(str(lora.all), "base")
    assert set(p.spec.models) == {"base", "tuned", "mine"}
    assert f"tuned: {lora.all} (LoRA over base)" in p.graph()
    # under Ray too: the adapter's actor is given its base's entry and loads the base's weights itself
    ray = Pipeline("p", models={"base": fam.parent, "tuned": AdapterSpec(str(lora.all), "base")},
                   executor="ray").agent("summarizer", model="tuned", max_words=20)
    assert ray.spec.executor.kind == "ray" and ray.spec.models["tuned"] == AdapterSpec(str(lora.all), "base")


def _agent(name: str, model: str) -> dict[str, object]:
    return {"name": name, "model": model,
            "spec": {"role": "You are careful.", "task": "Summarise the document.",
                     "generation": {"max_new_tokens": 6, "temperature": 0.0}}}


@pytest.mark.real_model
def test_a_lora_adapter_over_the_bundled_root_shares_its_weights(tmp_path):
    """The bundled SmolLM2 root with an upper-half adapter, when the family is built on this machine (skipped
    otherwise: building it is the real-family fixture's job, minutes long)."""
    from orchestra.errors import FamilyError
    from orchestra.family.manifest import load_family

    try:
        family = load_family(None)
        root = Path(family.member("root").path)
    except FamilyError:
        pytest.skip("the bundled family is not built here")
    adapter = make_adapter(root, tmp_path / "smol_upper", list(range(15, 30)), 4, rank=8)
    registry = ModelRegistry({"root": "root", "tuned": AdapterSpec(str(adapter), "root")}, family=family,
                             default_device="cpu")
    base, tuned = registry.load("root"), registry.load("tuned")
    assert tuned.info.adapter.untouched_layers == 15
    with torch.no_grad():
        assert torch.allclose(tuned.model(IDS).logits, _peft_logits(root, adapter), atol=1e-5)
    alone, together = _storage_bytes(base.model), _storage_bytes(base.model, tuned.model)
    assert together - alone == tuned.info.adapter.adapter_bytes < alone / 100
