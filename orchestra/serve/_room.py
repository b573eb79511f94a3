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

__all__ = ["RoomLayer", "room_cache", "ROOM_CHUNK"]

ROOM_CHUNK = 64
"""Spare positions a layer is given (and grows by, at least): the reply lengths the server expects."""


class RoomLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with spare positions."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int = ROOM_CHUNK) -> None:
        super().__init__()
        self.device = keys.device
        self._length = keys.shape[-2]
        self._k = _with_room(keys, self._length + room)
        self._v = _with_room(values, self._length + room)
        self._view()
        self.is_initialized = True

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
            self._k = _with_room(self._k[..., : self._length, :], capacity)
            self._v = _with_room(self._v[..., : self._length, :], capacity)
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


def _with_room(t: torch.Tensor, capacity: int) -> torch.Tensor:
    out = t.new_empty(*t.shape[:-2], capacity, t.shape[-1])
    out[..., : t.shape[-2], :] = t
    return out


def room_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], room: int = ROOM_CHUNK) -> DynamicCache:
    """A `DynamicCache` of `RoomLayer`s holding copies of `layers` with `room` spare positions each."""
    cache = DynamicCache()
    cache.layers = [RoomLayer(k, v, room) for k, v in layers]
    return cache
