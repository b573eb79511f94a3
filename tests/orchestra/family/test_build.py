from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchestra.errors import FamilyBuildError, FamilyError, FamilyHomeError, MemberNotFoundError
from orchestra.family import MEMBERS, FamilyManifest, build_family, load_family
from orchestra.family.build import MemberSpec, _read_valid_record, _save_member


def test_home_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(FamilyHomeError, match="not a directory"):
        build_family(f)
    with pytest.raises(FamilyHomeError, match="cannot create"):
        build_family(f / "sub")


def test_load_family_on_empty_home_says_how_to_build(tmp_path):
    with pytest.raises(FamilyError, match="orchestra family build"):
        load_family(tmp_path)


def _tiny(tiny_family):
    return AutoModelForCausalLM.from_pretrained(tiny_family.parent), AutoTokenizer.from_pretrained(tiny_family.parent)


def test_failed_write_leaves_nothing_that_looks_valid(tiny_family, tmp_path, monkeypatch):
    model, tok = _tiny(tiny_family)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(model, "save_pretrained", disk_full)
    spec = MemberSpec("m", "finetuned", "root")
    with pytest.raises(FamilyBuildError, match="free some disk space"):
        _save_member(model, tok, spec, tmp_path / "m", None)
    assert list(tmp_path.iterdir()) == []


def test_saved_member_is_valid_until_its_weights_change(tiny_family, tmp_path):
    model, tok = _tiny(tiny_family)
    record = _save_member(model, tok, MemberSpec("m", "finetuned", "root"), tmp_path / "m", None)
    assert _read_valid_record(tmp_path / "m") == record
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
    weights = next((tmp_path / "m").glob("*.safetensors"))
    with open(weights, "r+b") as fh:  # truncation: a half-copied member must not look valid
        fh.truncate(weights.stat().st_size // 2)
    assert _read_valid_record(tmp_path / "m") is None


# ---- the real SmolLM2 family -------------------------------------------------------------------


@pytest.mark.real_model
def test_family_has_root_and_three_distinct_relatives(real_family: FamilyManifest):
    roles = {r.role for r in real_family.members.values()}
    assert roles == {"root", "finetuned", "quantized", "distilled"}
    assert len({r.fingerprint["weights"] for r in real_family.members.values()}) == 4
    assert len({r.fingerprint["tokenizer"] for r in real_family.members.values()}) == 1
    for record in real_family.members.values():
        assert (Path(record.path) / "config.json").is_file()
        config = json.loads((Path(record.path) / "config.json").read_text())
        assert "quantization_config" not in config
        if record.role == "root":
            assert record.parent is None and record.divergence is None
            continue
        d = record.divergence
        assert record.parent == MEMBERS[0].name
        # measured, not copied: a relative is measurably different, yet far closer than an unrelated model
        assert 0.005 < d.kl < 5.0, d
        assert 0.1 < d.top1 < 0.995, d
    assert real_family.member("distilled").num_layers == 20
    assert real_family.member("root").num_layers == 30


@pytest.mark.real_model
def test_family_json_round_trips_and_rebuild_reuses(real_family: FamilyManifest):
    again = build_family(real_family.home)
    assert again == real_family
    loaded = load_family(real_family.home)
    assert loaded.member_path("finetuned") == real_family.member_path("smollm2-135m-docstrings")
    with pytest.raises(MemberNotFoundError, match="known:"):
        loaded.member("base-7b")


@pytest.mark.real_model
def test_quantized_member_is_really_4bit_grouped(real_family: FamilyManifest):
    from safetensors import safe_open

    path = next(real_family.member_path("quantized").glob("*.safetensors"))
    with safe_open(str(path), framework="pt") as sf:
        w = sf.get_tensor("model.layers.3.mlp.down_proj.weight")
    groups = w.view(w.shape[0], -1, 64)
    for g in range(groups.shape[1]):
        assert len(torch.unique(groups[0, g])) <= 16


@pytest.mark.real_model
def test_root_generates_sensible_text(real_family: FamilyManifest):
    path = real_family.member_path("root")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
