"""The block layout a connector reads vLLM's caches by is learnt from the backend's own write, whatever its packing."""

from __future__ import annotations

import pytest
import torch

from orchestra.vllm._layout import BlockLayout, slots_for


def transposed_keys(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A CPU-kernel-like packing: per block and head, keys as [head_size, block_size], then values as written."""
    blocks, heads, block_size, packed = cache.shape
    d = packed // 2
    view = cache.view(blocks, heads, block_size * 2, d)
    keys = view[:, :, :block_size, :].reshape(blocks, heads, d, block_size)  # transposed storage
    values = view[:, :, block_size:, :]
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, block_size)
        keys[b, :, :, t] = k[i]
        values[b, :, t, :] = v[i]


def interleaved(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Another packing: K and V of a token side by side in the last dimension ([B, H, N, 2D], flash-like)."""
    block_size = cache.shape[2]
    d = cache.shape[3] // 2
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, block_size)
        cache[b, :, t, :d] = k[i]
        cache[b, :, t, d:] = v[i]


@pytest.mark.parametrize("write", [transposed_keys, interleaved], ids=["transposed-keys", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layout_learnt_from_a_backends_write_reads_back_what_was_written(write, dtype) -> None:
    heads, block_size, head_size = 2, 16, 32
    layout = BlockLayout.probe(write, (heads, block_size, 2 * head_size), dtype)
    cache = torch.zeros(6, heads, block_size, 2 * head_size, dtype=dtype)
    tokens = 3 * block_size - 5
    k = torch.randn(tokens, heads, head_size).to(dtype)
    v = torch.randn(tokens, heads, head_size).to(dtype)
    blocks = [4, 1, 5]  # a request's blocks are wherever the pool had room
    write(k, v, cache, torch.tensor(slots_for(blocks, block_size, 0, tokens)))
    key, value = layout.read(cache, blocks, tokens)
    assert torch.equal(key, k) and torch.equal(value, v)


def test_a_backend_that_scales_what_it_stores_is_refused() -> None:
    def scaled(k, v, cache, slots):  # an fp8-like cache: values cannot be read back exactly
        interleaved(k * 0.37, v * 0.37, cache, slots)

    with pytest.raises(ValueError, match="cannot be read back exactly|not a permutation"):
        BlockLayout.probe(scaled, (2, 16, 64), torch.float32)


def test_reading_more_tokens_than_the_blocks_hold_is_an_error() -> None:
    layout = BlockLayout.probe(interleaved, (1, 16, 8), torch.float32)
    with pytest.raises(ValueError, match="need 2 blocks"):
        layout.read(torch.zeros(4, 1, 16, 8), [0], 20)
