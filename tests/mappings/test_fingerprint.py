from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mappings.fingerprint import fingerprint_dir, fingerprint_model


def test_in_memory_and_on_disk_fingerprints_agree(tiny_family):
    model = AutoModelForCausalLM.from_pretrained(tiny_family.parent)
    tok = AutoTokenizer.from_pretrained(tiny_family.parent)
    assert fingerprint_model(model, tok) == fingerprint_dir(tiny_family.parent)


def test_each_part_changes_only_its_own_hash(tiny_family, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_family.parent)
    tok = AutoTokenizer.from_pretrained(tiny_family.parent)
    base = fingerprint_model(model, tok)

    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    changed = fingerprint_model(model, tok)
    assert changed.weights != base.weights
    assert (changed.config, changed.tokenizer) == (base.config, base.tokenizer)
    assert changed.combined != base.combined

    model.config.rope_theta = 12345.0
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 12345.0}
    assert fingerprint_model(model, tok).config != base.config


def test_parent_and_child_differ_in_weights_only(tiny_family):
    parent, child = fingerprint_dir(tiny_family.parent), fingerprint_dir(tiny_family.child)
    assert parent.weights != child.weights
    assert parent.config == child.config and parent.tokenizer == child.tokenizer
