"""RoomLayer: a decoding step writes into spare positions instead of copying the layer."""

from __future__ import annotations

import torch

from orchestra.serve._room import ROOM_CHUNK, RoomLayer, room_cache


def test_steps_write_in_place_until_the_room_is_used_then_grow_and_match_concatenation():
    k, v = torch.randn(2, 3, 10, 4), torch.randn(2, 3, 10, 4)
    layer = RoomLayer(k, v, room=5)
    expect_k, expect_v = k.clone(), v.clone()
    buffer = layer._k.data_ptr()
    for step in range(12):
        nk, nv = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        keys, values = layer.update(nk, nv)
        expect_k, expect_v = torch.cat([expect_k, nk], 2), torch.cat([expect_v, nv], 2)
        assert torch.equal(keys, expect_k) and torch.equal(values, expect_v)
        assert layer.get_seq_length() == 11 + step
        if step < 5:  # within the room: the same buffer
            assert layer._k.data_ptr() == buffer
    assert layer._k.data_ptr() != buffer  # grew once past the room
    assert layer._k.shape[2] >= 10 + 12


def test_the_cache_holds_copies_so_the_callers_tensors_are_never_written():
    k, v = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
    cache = room_cache([(k, v)])
    cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)
    assert k.abs().sum() == 0 and cache.get_seq_length() == 4
    assert cache.layers[0]._k.shape[2] == 3 + ROOM_CHUNK


def test_batch_selection_and_crop_keep_the_view_consistent():
    k = torch.arange(2 * 1 * 4 * 2, dtype=torch.float32).reshape(2, 1, 4, 2)
    layer = RoomLayer(k, k.clone())
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, k[1:])
    layer.crop(-1)
    assert torch.equal(layer.keys, k[1:, :, :3]) and layer.get_seq_length() == 3
