"""LoRA adapters made with peft for benchmarks, tests and the GPU check: members of an own family.

An adapter with LoRA B factors at zero is the identity, so these are given small random B factors:
a stand-in for a user's fine-tune that changes exactly the layers and projections it names.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["ALL_PROJECTIONS", "make_lora_adapter", "distinct_bytes"]

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama-style decoder block: what an adapter that touches everything targets."""


def make_lora_adapter(base: str | Path, out: str | Path, *, layers: Sequence[int] | None = None,
                      targets: Sequence[str] = ALL_PROJECTIONS, rank: int = 8, scale: float = 0.01,
                      seed: int = 0) -> Path:
    """A peft LoRA adapter over the model folder `base` on `layers` (None: all) and `targets`, saved to `out`.

    B factors are drawn from N(0, `scale`) with `seed`, so the adapter is reproducible. An adapter already
    saved at `out` is kept (its ``adapter_model.safetensors`` is there), so reruns do not remake it.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out_path = Path(out)
    if (out_path / "adapter_model.safetensors").is_file():
        return out_path
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                        layers_to_transform=list(layers) if layers is not None else None)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(str(out_path))
    return out_path


def distinct_bytes(*models: object) -> int:
    """Bytes of the tensors (parameters and buffers) of `models`, each storage counted once.

    Adapter members share their base's tensors: this is what they hold together, not the sum of each.
    """
    seen: dict[int, int] = {}
    for model in models:
        for t in [*model.parameters(), *model.buffers()]:  # type: ignore[attr-defined]
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
