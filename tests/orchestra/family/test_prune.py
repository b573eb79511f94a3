from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from orchestra.family._prune import drop_layers


def test_dropped_model_runs_and_caches_one_entry_per_kept_layer(tiny_family):
    model = AutoModelForCausalLM.from_pretrained(tiny_family.parent).eval()
    n = model.config.num_hidden_layers
    kept_first = model.model.layers[0]
    drop_layers(model, [1])
    assert model.config.num_hidden_layers == n - 1
    assert model.model.layers[0] is kept_first
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(n - 1))
    ids = torch.arange(3, 20).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    assert len(out.past_key_values.layers) == n - 1
    assert torch.isfinite(out.logits).all()


def test_dropping_a_layer_that_does_not_exist_is_refused(tiny_family):
    model = AutoModelForCausalLM.from_pretrained(tiny_family.parent)
    with pytest.raises(ValueError, match="has .* layers"):
        drop_layers(model, [99])
