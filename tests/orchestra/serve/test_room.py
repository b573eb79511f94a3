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


def test_adding_a_row_left_pads_every_row_to_the_longest_and_leaves_room():
    from orchestra.serve._room import add_row

    a = torch.randn(1, 2, 5, 4)
    b = torch.randn(1, 2, 8, 4)
    batch = add_row(None, [(a, a + 1)], room=3)
    assert batch.get_seq_length() == 5 and batch.layers[0].capacity == 8
    batch = add_row(batch, [(b, b + 1)], room=3)
    layer = batch.layers[0]
    keys, values = layer.used()
    assert keys.shape == (2, 2, 8, 4) and layer.capacity == 11
    assert torch.equal(keys[0, :, 3:], a[0]) and keys[0, :, :3].abs().sum() == 0
    assert torch.equal(keys[1], b[0]) and torch.equal(values[1], b[0] + 1)
    buffer = layer._k.data_ptr()
    batch.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), 0)
    assert layer._k.data_ptr() == buffer and batch.get_seq_length() == 9  # a step writes into the room


def test_a_shorter_row_added_later_is_padded_on_the_left_not_the_batch():
    from orchestra.serve._room import add_row

    long, short = torch.randn(1, 1, 6, 2), torch.randn(1, 1, 2, 2)
    batch = add_row(add_row(None, [(long, long)]), [(short, short)])
    keys, _ = batch.layers[0].used()
    assert torch.equal(keys[0], long[0]) and torch.equal(keys[1, :, 4:], short[0])
    assert keys[1, :, :4].abs().sum() == 0


def test_dropping_leading_padding_is_a_view_of_the_same_buffer():
    k = torch.arange(12, dtype=torch.float32).reshape(1, 1, 6, 2)
    layer = RoomLayer(k, k.clone(), room=2)
    before = layer._k.untyped_storage().data_ptr()
    layer.drop_front(2)
    assert layer.get_seq_length() == 4 and torch.equal(layer.keys, k[:, :, 2:])
    assert layer._k.untyped_storage().data_ptr() == before
