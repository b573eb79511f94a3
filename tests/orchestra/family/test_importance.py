from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from orchestra.family.importance import LayerImportance, measure_importance, skip_kl
from tests.tiny_family import build_tiny_family


@pytest.fixture(scope="module")
def tiny_llama(tiny_root):
    return build_tiny_family(tiny_root, "llama").parent


def _model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _windows():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (4, 48), generator=gen)]


def _make_identity(model, idx: int) -> None:
    """Layer `idx` adds nothing to the residual stream: its attention and MLP outputs are zero."""
    with torch.no_grad():
        model.model.layers[idx].self_attn.o_proj.weight.zero_()
        model.model.layers[idx].mlp.down_proj.weight.zero_()


def test_a_layer_that_adds_nothing_measures_as_unimportant_and_is_dropped(tiny_llama):
    model = _model(tiny_llama)  # 4 layers
    _make_identity(model, 2)
    imp = measure_importance(model, _windows(), 1, skip_kl_windows=_windows())
    assert len(imp.block_influence) == 4 and len(imp.skip_kl) == 4 and len(imp.block_distance) == 4
    assert imp.block_influence[2] == pytest.approx(0.0, abs=1e-5)
    assert min(imp.block_influence[i] for i in (0, 1, 3)) > 1e-3
    assert imp.skip_kl[2] == pytest.approx(0.0, abs=1e-6)
    assert min(imp.skip_kl[i] for i in (0, 1, 3)) > 1e-4
    assert imp.drop == [2]
    assert LayerImportance.from_dict(imp.as_dict()).drop == [2]


def test_skip_kl_choice_need_not_be_consecutive(tiny_llama):
    model = _model(tiny_llama)
    _make_identity(model, 1)
    _make_identity(model, 3)
    imp = measure_importance(model, _windows(), 2, keep_last=0, skip_kl_windows=_windows())
    assert imp.drop == [1, 3]
    assert imp.skip_kl[2] > 1e-4


def test_without_skip_kl_a_consecutive_run_is_chosen_keeping_first_and_last_layers(tiny_llama):
    model = _model(tiny_llama)
    _make_identity(model, 0)  # the cheapest layer to drop, but layer 0 is never dropped
    imp = measure_importance(model, _windows(), 2)
    assert imp.drop == [1, 2]  # the only run of 2 that keeps layers 0 and 3
    assert len(imp.block_distance) == 3
    with pytest.raises(ValueError, match="cannot drop"):
        measure_importance(model, _windows(), 3)


def test_skip_kl_restores_the_model(tiny_llama):
    model = _model(tiny_llama)
    w = _windows()
    with torch.no_grad():
        before = model(input_ids=w[0], use_cache=False).logits
    skip_kl(model, w)
    assert len(model.model.layers) == model.config.num_hidden_layers == 4
    with torch.no_grad():
        assert torch.equal(model(input_ids=w[0], use_cache=False).logits, before)
