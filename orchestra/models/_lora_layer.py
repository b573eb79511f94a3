"""The LoRA-wrapped Linear layer `orchestra.models.lora.attach_lora` puts in an adapter member's module tree.

Apart from `orchestra.models.lora` so that torch is imported only when an adapter is attached (a module class
needs torch where it is defined).
"""

from __future__ import annotations

import torch

__all__ = ["LoraLinear"]


class LoraLinear(torch.nn.Module):
    """``base_layer(x) + (x Aᵀ Bᵀ) * scaling``, in the same operations and order as peft's LoRA ``Linear`` at
    inference (factors in float32, the sum cast back to the base's output dtype), so outputs match peft's."""

    def __init__(self, base_layer: torch.nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scaling: float) -> None:
        super().__init__()
        self.base_layer = base_layer
        # parameters (frozen), not buffers: the member's parameters list them beside the shared base weights
        self.lora_A = torch.nn.Parameter(lora_a, requires_grad=False)
        self.lora_B = torch.nn.Parameter(lora_b, requires_grad=False)
        self.scaling = scaling

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        low = torch.nn.functional.linear(x.to(self.lora_A.dtype), self.lora_A)
        delta = torch.nn.functional.linear(low, self.lora_B) * self.scaling
        return (result + delta).to(result.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"
