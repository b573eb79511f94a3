"""A full-attention cache layer with room to grow, so a decoding step writes its token in place.

transformers' `DynamicLayer` concatenates at every step: each new token allocates the whole layer
again and copies it, and while the batch decoder still holds the previous step's tensors, two copies
of the batch's K/V live at once (with glibc keeping the freed one in its arenas). `RoomLayer` keeps
a buffer with spare positions; a step writes into it and hands out views of the used part. It grows
by whole chunks, so a 32-token reply over a 2k-token prompt copies the layer at most once.

Imported only by the batch decoder when it decodes (it subclasses a transformers class).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["RoomLayer", "room_cache", "add_row", "ROOM_CHUNK"]

ROOM_CHUNK = 64
"""Spare positions a layer is given (and grows by, at least): the reply lengths the server expects."""


class RoomLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with spare positions."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int = ROOM_CHUNK, *,
                 dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        """Copies of `keys` and `values` (in `dtype` on `device`, when given) with `room` spare positions."""
        super().__init__()
        self._length = keys.shape[-2]
        self._k = _with_room(keys, self._length + room, dtype, device)
        self._v = _with_room(values, self._length + room, dtype, device)
        self.device = self._k.device
        self._view()
        self.is_initialized = True

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> RoomLayer:
        """A layer over buffers the caller filled up to `length` (no copy): their positions past it are the room."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer.device, layer._length, layer._k, layer._v = keys.device, length, keys, values
        layer._view()
        layer.is_initialized = True
        return layer

    @property
    def capacity(self) -> int:
        """Positions the buffers hold, used and spare."""
        return int(self._k.shape[-2])

    @property
    def capacity_rows(self) -> int:
        """Rows (batch entries) the buffers hold."""
        return int(self._k.shape[0])

    def used(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values of the used positions."""
        return self._view()

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._k[..., : self._length, :], self._v[..., : self._length, :]
        self.keys, self.values = keys, values
        return keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        end = self._length + n
        if end > self._k.shape[-2]:  # out of room: one copy into a buffer with room for the next chunk
            capacity = end + max(ROOM_CHUNK, end // 8)
            self._k = _with_room(self._k[..., : self._length, :], capacity, None, None)
            self._v = _with_room(self._v[..., : self._length, :], capacity, None, None)
        self._k[..., self._length:end, :] = key_states
        self._v[..., self._length:end, :] = value_states
        self._length = end
        return self._view()

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self._length = max(0, self._length + tokens_to_remove)
        self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k = self._k.repeat_interleave(repeats, dim=0)
        self._v = self._v.repeat_interleave(repeats, dim=0)
        self._view()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        index = beam_idx.to(self._k.device)
        self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
        self._view()

    def reset(self) -> None:
        self._length = 0
        self._view()

    def drop_front(self, positions: int) -> None:
        """Forget the first `positions` (left padding no row uses any more): a view, no copy."""
        if positions > 0:
            self._k, self._v = self._k[..., positions:, :], self._v[..., positions:, :]
            self._length -= positions
            self._view()


def _with_room(t: torch.Tensor, capacity: int, dtype: torch.dtype | None,
               device: torch.device | None) -> torch.Tensor:
    out = torch.empty(*t.shape[:-2], capacity, t.shape[-1], dtype=dtype or t.dtype, device=device or t.device)
    out[..., : t.shape[-2], :] = t
    return out


def _room_layer(layer: object) -> RoomLayer:
    if not isinstance(layer, RoomLayer):
        raise TypeError(f"a batch cache holds RoomLayers, not {type(layer).__name__}")
    return layer


def room_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], room: int = ROOM_CHUNK, *,
               dtype: torch.dtype | None = None, device: torch.device | None = None) -> DynamicCache:
    """A `DynamicCache` of `RoomLayer`s holding copies of `layers` with `room` spare positions each."""
    cache = DynamicCache()
    cache.layers = [RoomLayer(k, v, room, dtype=dtype, device=device) for k, v in layers]
    return cache


def add_row(batch: DynamicCache | None, layers: list[tuple[torch.Tensor, torch.Tensor]],
            room: int = ROOM_CHUNK) -> DynamicCache:
    """`batch`'s rows and one more (`layers`, batch size 1), left-padded to a common length, in new buffers.

    One copy of each row straight into a buffer with `room` spare positions: the rows are neither
    concatenated first nor copied again before the next step. `batch` is updated in place layer by
    layer, so the old and new buffers coexist for one layer at a time, never for the whole cache.
    `layers` is emptied as its layers are copied, so a caller holding no other reference to the new
    row's tensors frees each as soon as the batch has it (the row is not held twice while it joins).
    Padding positions are zeros (the caller's attention mask hides them).
    """
    old = [] if batch is None else [_room_layer(layer) for layer in batch.layers]
    width = max([layer.get_seq_length() for layer in old] + [k.shape[-2] for k, _ in layers])
    out = batch if batch is not None else DynamicCache()
    if batch is None:
        out.layers = []
    for i in range(len(layers)):
        k, v = layers.pop(0)
        rows = old[i].capacity_rows if old else 0
        bk = k.new_zeros(rows + 1, k.shape[1], width + room, k.shape[-1])
        bv = v.new_zeros(rows + 1, v.shape[1], width + room, v.shape[-1])
        if old:
            held = old[i].get_seq_length()
            held_k, held_v = old[i].used()
            bk[:rows, :, width - held:width] = held_k
            bv[:rows, :, width - held:width] = held_v
        bk[rows, :, width - k.shape[-2]:width] = k[0]
        bv[rows, :, width - v.shape[-2]:width] = v[0]
        layer = RoomLayer.over(bk, bv, width)
        if old:
            out.layers[i] = layer
            old[i] = layer  # the previous buffers are freed here, one layer at a time
        else:
            out.layers.append(layer)
    return out
