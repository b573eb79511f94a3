"""Weight-only symmetric quantization (simulated: weights are stored dequantized).

Two granularities: groups of `group_size` inputs (the 4-bit member) and one scale per output
channel, ``group_size=None`` (int8 weight-only, what production serving typically deploys).
"""

from __future__ import annotations

import torch


def quantize_dequantize(weight: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """Round each group of `group_size` input weights (a whole output row when None) to `bits`-bit symmetric
    integers and back."""
    out_features, in_features = weight.shape
    group_size = in_features if group_size is None else group_size
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group size {group_size}")
    w = weight.detach().to(torch.float32).reshape(out_features, in_features // group_size, group_size)
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / qmax
    q = torch.clamp(torch.round(w / scale), -qmax - 1, qmax)
    return (q * scale).reshape(out_features, in_features).to(weight.dtype)


def quantize_linear_layers(model: torch.nn.Module, bits: int, group_size: int | None) -> int:
    """Quantize every nn.Linear inside the decoder layers in place; returns how many were changed."""
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                module.weight.copy_(quantize_dequantize(module.weight, bits, group_size))
                count += 1
    return count
