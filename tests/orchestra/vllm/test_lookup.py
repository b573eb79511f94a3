"""The connector's family side for an engine serving a base and its LoRA adapters (no vLLM needed): each adapter is a
member of its own, with its own exact namespace, and finds what its base or a sibling adapter stored."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestra.vllm._lookup import ConnectorSetupError, FamilyLookup
from orchestra.vllm._settings import ConnectorSettings
from tests.fixtures.adapters import make_lora_adapter
from tests.tiny_family import build_tiny_family


@pytest.fixture(scope="module")
def engine_family(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from orchestra.family.init import init_family

    tmp = tmp_path_factory.mktemp("lookup")
    tiny = build_tiny_family(tmp / "models", "llama", head_dim=32)
    init_family("tiny", [f"base={tiny.parent}", f"tuned={tiny.child}"], home=tmp / "home")
    return {"tiny": tiny, "home": tmp / "home",
            "adapters": {"legal": str(make_lora_adapter(tiny.parent, tmp / "legal", scale=0.05, seed=1)),
                         "code": str(make_lora_adapter(tiny.parent, tmp / "code", scale=0.05, seed=2))}}


def lookup_for(family: dict, tmp: Path, **settings: object) -> FamilyLookup:
    values = {"home": str(family["home"]), "member": "base", "store": str(tmp / "kv"), "min_tokens": 16,
              "min_mapped_tokens": 16, "warm": False, "adapters": family["adapters"],
              "mapping_dir": str(tmp / "mappings"), **settings}
    return FamilyLookup(ConnectorSettings.model_validate(values), dtype="float32", model_path=str(family["tiny"].parent))


def test_each_adapter_is_a_member_of_its_own_with_its_own_exact_namespace(engine_family: dict, tmp_path: Path) -> None:
    lookup = lookup_for(engine_family, tmp_path)
    try:
        assert lookup.members == ("base", "legal", "code")
        assert lookup.member_for(None) == "base" and lookup.member_for("legal") == "legal"
        assert lookup.member_for("unheard-of") is None
        spaces = {m: lookup.namespace_of(m) for m in lookup.members}
        assert len({ns.member_fingerprint for ns in spaces.values()}) == 3
        assert all(ns.kind == "exact" for ns in spaces.values())
    finally:
        lookup.close()


def test_an_adapter_maps_what_its_base_stored_and_a_sibling_what_another_adapter_stored(engine_family: dict,
                                                                                      tmp_path: Path) -> None:
    ids = tuple(range(3, 3 + 96))
    lookup = lookup_for(engine_family, tmp_path, calibrate=True, calibrate_tokens=512)
    try:
        assert lookup.mappable("legal", ids) is None  # an empty store
        lease = lookup.cache_for("base").acquire_sync("base", ids)  # what the engine's base request saves
        lease.release()
        assert lookup.cache_for("base").disk_tier is not None and lookup.cache_for("base").disk_tier.flush(60)
        found = lookup.mappable("legal", ids + (7, 8))
        assert found is not None and (found.source, found.length) == ("base", len(ids))
        build = lookup.submit("legal", "base", ids).result(timeout=600)
        assert build.kind == "mapped" and build.source == "base" and Path(build.handoff or "").is_file()
        # nothing of the adapter's own was stored: a mapped cache never passes for exact
        assert lookup.own_entry("legal", ids) is None
        longer = ids + tuple(range(40, 72))
        lookup.cache_for("legal").acquire_sync("legal", longer, allow_mapped=False).release()  # legal's own prefill
        assert lookup.cache_for("legal").disk_tier.flush(60)
        assert lookup.own_entry("legal", longer) is not None
        found = lookup.mappable("code", longer + (9,))
        assert found is not None and (found.source, found.length) == ("legal", len(longer))
    finally:
        lookup.close()


def test_without_calibrate_a_missing_adapter_map_is_refused_not_computed(engine_family: dict, tmp_path: Path) -> None:
    ids = tuple(range(3, 3 + 96))
    lookup = lookup_for(engine_family, tmp_path)
    try:
        lookup.cache_for("base").acquire_sync("base", ids).release()
        assert lookup.cache_for("base").disk_tier.flush(60)
        found = lookup.mappable("code", ids)  # offered, so that the refusal below is counted
        assert found is not None and found.source == "base"
        build = lookup.submit("code", "base", ids).result(timeout=600)
        assert build.kind == "refused" and "no mapping base -> code" in (build.reason or "")
    finally:
        lookup.close()


@pytest.mark.parametrize(("adapters", "says"), [
    ({"tuned": "{legal}"}, "has the name of a family member"),
    ({"legal": "{models}"}, "holds no adapter_config.json"),
])
def test_a_wrong_adapter_setting_stops_the_engine_with_what_to_fix(engine_family: dict, tmp_path: Path,
                                                                   adapters: dict, says: str) -> None:
    folders = {k: v.format(legal=engine_family["adapters"]["legal"], models=engine_family["tiny"].parent)
               for k, v in adapters.items()}
    with pytest.raises(ConnectorSetupError, match=says):
        lookup_for(engine_family, tmp_path, adapters=folders)
