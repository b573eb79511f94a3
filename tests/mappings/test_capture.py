from __future__ import annotations

import pytest
import torch

from mappings.capture import (
    capture_kv,
    capture_queries,
    capture_texts,
    capture_windows,
    decoder_layers,
    kv_shape,
    make_windows,
)
from mappings.errors import CorpusTooSmallError, NonFiniteKVError, UnsupportedModelError
from mappings.fit import RegressionStats
from mappings.metrics import attention_output
from tests.mappings.conftest import load, load_tokenizer

TEXTS = [
    "The committee reviewed the annual report.",
    "def parse(line):\n    return [int(x) for x in line.split(',')] and then some more words follow here",
    "Costs fell.",
]


def test_shapes_dtype_and_positions(tiny_family):
    model = load(tiny_family.parent)
    shape = kv_shape(model.config)
    cap = capture_texts(model, load_tokenizer(tiny_family.parent), TEXTS, hidden_states=True, queries=True)
    n = sum(cap.lengths)
    assert cap.num_layers == shape.num_layers == len(cap.values)
    for k, v in zip(cap.keys, cap.values, strict=True):
        assert k.shape == v.shape == (n, shape.kv_heads, shape.head_dim)
        assert k.dtype == v.dtype == torch.float32
    assert cap.positions.tolist() == [p for length in cap.lengths for p in range(length)]
    assert len(cap.hidden) == shape.num_layers and cap.hidden[0].shape == (n, model.config.hidden_size)
    assert cap.queries[0].shape == (n, model.config.num_attention_heads, shape.head_dim)
    dense_k, dense_v = cap.dense(0)
    assert dense_k.shape == (3, shape.kv_heads, max(cap.lengths), shape.head_dim)
    assert float(dense_k[2, :, cap.lengths[2]:].abs().sum()) == 0.0  # padding stays zero


def test_low_precision_model_is_captured_in_fp32(llama_family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_family.parent), dtype=torch.bfloat16).eval()
    cap = capture_kv(model, torch.randint(3, 300, (1, 12)))
    assert cap.keys[0].dtype == torch.float32


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_never_enters_statistics(tiny_family, side):
    """Statistics from one padded batch equal those from running each sequence alone."""
    model, tok = load(tiny_family.parent), load_tokenizer(tiny_family.parent)
    batch = capture_texts(model, tok, TEXTS, padding_side=side)
    assert len(set(batch.lengths)) == 3  # really padded
    singles = [capture_texts(model, tok, [t]) for t in TEXTS]
    for layer in range(batch.num_layers):
        padded = RegressionStats.from_data(batch.keys[layer].flatten(1), batch.values[layer].flatten(1))
        alone = RegressionStats.zeros(padded.p, padded.q)
        for s in singles:
            alone.update(s.keys[layer].flatten(1), s.values[layer].flatten(1))
        assert padded.n == alone.n == sum(batch.lengths)
        torch.testing.assert_close(padded.xtx, alone.xtx, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(padded.xty, alone.xty, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(padded.sum_x, alone.sum_x, atol=1e-4, rtol=1e-5)


def test_captured_queries_reproduce_the_attention_output(tiny_family):
    """softmax(QKᵀ)V from captured Q/K/V equals what the attention module feeds its output projection."""
    model = load(tiny_family.parent)
    ids = torch.randint(3, 300, (2, 20))
    seen = {}
    layer = decoder_layers(model)[1].self_attn
    handle = layer.o_proj.register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0].detach()))
    try:
        cap = capture_kv(model, ids, queries=True)
    finally:
        handle.remove()
    def dense(t):
        return t.view(2, 20, *t.shape[1:]).transpose(1, 2)

    out = attention_output(dense(cap.queries[1]), dense(cap.keys[1]), dense(cap.values[1]), layer.scaling)
    torch.testing.assert_close(out, seen["x"], atol=1e-5, rtol=1e-4)


def test_nan_in_a_valid_position_is_refused(llama_family):
    model = load(llama_family.parent)
    attn = decoder_layers(model)[2].self_attn

    def poison(_module, _inputs, output):
        output = output.clone()
        output[0, 3, 0] = float("nan")
        return output

    handle = attn.v_proj.register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteKVError, match="values of layer 2"):
            capture_kv(model, torch.randint(3, 300, (1, 8)))
        # the check can be switched off (e.g. to inspect the bad tensor)
        cap = capture_kv(model, torch.randint(3, 300, (1, 8)), check_finite=False)
        assert torch.isnan(cap.values[2]).any()
    finally:
        handle.remove()


def test_all_padding_batch_is_refused(llama_family):
    with pytest.raises(CorpusTooSmallError):
        capture_kv(load(llama_family.parent), torch.ones(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def test_windows_and_streaming(llama_family):
    model = load(llama_family.parent)
    windows = make_windows(list(range(3, 103)), 16)
    assert len(windows) == 6 and all(w.numel() == 16 for w in windows)  # the 4-token tail is dropped
    assert make_windows(list(range(10)), 16) == []
    caps = list(capture_windows(model, windows, batch_size=4, progress=False))
    assert [len(c.lengths) for c in caps] == [4, 2]
    whole = capture_kv(model, torch.stack(windows[:4]))
    torch.testing.assert_close(caps[0].keys[1], whole.keys[1])


def test_capture_queries_records_every_layer_and_removes_its_hooks(tiny_family):
    model = load(tiny_family.parent)
    layers = decoder_layers(model)
    ids = torch.randint(3, 300, (2, 7))
    with capture_queries(model) as queries:
        model(input_ids=ids)
        assert all(layer.self_attn.q_proj._forward_hooks for layer in layers)
    assert sorted(queries) == list(range(len(layers)))
    heads, head_dim = model.config.num_attention_heads, kv_shape(model.config).head_dim
    assert queries[0].reshape(2, 7, heads, head_dim).shape == (2, 7, heads, head_dim)
    assert not any(layer.self_attn.q_proj._forward_hooks for layer in layers)


def test_capture_queries_without_a_query_projection_leaves_no_hook(tiny_family):
    model = load(tiny_family.parent)
    layers = decoder_layers(model)
    last = layers[-1].self_attn
    q_proj = last.q_proj
    del last.q_proj
    try:
        with pytest.raises(UnsupportedModelError, match="no self_attn.q_proj"), capture_queries(model):
            pass
        assert not any(layer.self_attn.q_proj._forward_hooks for layer in layers[:-1])
    finally:
        last.q_proj = q_proj
