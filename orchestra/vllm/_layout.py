"""Where an attention backend keeps each token's K and V inside one of vLLM's cache blocks.

vLLM hands a connector each layer's cache as a ``[blocks, kv_heads, block_size, 2 * head_size]`` view,
but what sits where inside a block is the attention kernel's business: the CPU kernels store a block's
keys transposed (``[head_size, block_size]``, for their dot products), CUDA's flash attention stores
them as written, and other kernels pack otherwise. Writing needs no knowledge of it: the backend's own
``do_kv_cache_update`` writes tokens into slots. Reading does, and rather than hard-code each kernel's
packing this module asks the kernel: it writes coded values into a one-block scratch cache through the
same op and reads back where each (token, head, dim) landed. The codes are small integers, exact in
every float dtype a cache uses (bfloat16 included), so a permutation of any size is recovered digit by
digit; a kernel that scales or quantizes what it stores (an fp8 cache) is refused, as its values cannot
be read back exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BlockLayout", "WriteTokens", "slots_for"]

WriteTokens = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], None]
"""``write(key, value, kv_cache, slot_mapping)``: the backend's own write of ``[tokens, heads, dim]`` K and V."""

_DIGIT = 64  # codes 1..64: exact in bfloat16 (8 bits of mantissa) and in every wider float


@dataclass(frozen=True)
class BlockLayout:
    """Per (token in block, head, dim): the flat offset inside one block of its key and of its value."""

    block_size: int
    heads: int
    head_size: int
    key_offsets: torch.Tensor
    """``[block_size * heads * head_size]`` long: where key element (t, h, d) lives in a flattened block."""
    value_offsets: torch.Tensor

    @classmethod
    def probe(cls, write: WriteTokens, block_shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device | str = "cpu") -> BlockLayout:
        """Learn the layout of blocks shaped `block_shape` (``[heads, block_size, 2 * head_size]``) from `write`."""
        import torch

        heads, block_size, packed = block_shape
        head_size = packed // 2
        n = block_size * heads * head_size
        slots = torch.arange(block_size, device=device)
        offsets = []
        for coded in ("key", "value"):
            where: torch.Tensor | None = None
            source = torch.zeros(n, dtype=torch.long)
            base = 1
            while base < n:  # one digit of each element's index per pass
                codes = ((torch.arange(n) // base) % _DIGIT + 1).to(dtype).view(block_size, heads, head_size)
                zeros = torch.zeros_like(codes)
                scratch = torch.zeros((1, *block_shape), dtype=dtype, device=device)
                k, v = (codes, zeros) if coded == "key" else (zeros, codes)
                write(k.to(device), v.to(device), scratch, slots)
                flat = scratch.reshape(-1).to("cpu", torch.float64)
                held = torch.nonzero(flat, as_tuple=True)[0]
                if held.numel() != n or (where is not None and not torch.equal(held, where)):
                    raise ValueError(f"the attention backend stores a block's {coded}s where they cannot be read "
                                     "back exactly (a scaled or quantized KV cache?): use kv_cache_dtype auto")
                where = held
                source += (flat[held].round().to(torch.long) - 1) * base
                base *= _DIGIT
            assert where is not None
            if not torch.equal(torch.sort(source).values, torch.arange(n)):
                raise ValueError(f"the attention backend's {coded} layout is not a permutation of a block")
            positions = torch.empty(n, dtype=torch.long)
            positions[source] = where
            offsets.append(positions)
        return cls(block_size, heads, head_size, offsets[0], offsets[1])

    def read(self, kv_cache: torch.Tensor, block_ids: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `tokens` tokens' K and V, ``[tokens, heads, head_size]`` each, from the blocks `block_ids`."""
        import torch

        needed = -(-tokens // self.block_size)
        if needed > len(block_ids):
            raise ValueError(f"{tokens} tokens need {needed} blocks of {self.block_size}; the request holds "
                             f"{len(block_ids)}")
        index = torch.tensor(block_ids[:needed], device=kv_cache.device)
        blocks = kv_cache.index_select(0, index).reshape(needed, -1)
        shape = (needed * self.block_size, self.heads, self.head_size)
        key = blocks[:, self.key_offsets.to(kv_cache.device)].reshape(shape)[:tokens]
        value = blocks[:, self.value_offsets.to(kv_cache.device)].reshape(shape)[:tokens]
        return key, value


def slots_for(block_ids: list[int], block_size: int, start: int, stop: int) -> list[int]:
    """vLLM's slot numbers of token positions [start, stop) of a request holding `block_ids`."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]
