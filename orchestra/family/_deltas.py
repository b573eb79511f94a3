"""Merge a shipped LoRA delta (safetensors + adapter_config.json) into a model."""

from __future__ import annotations

from orchestra.errors import FamilyBuildError


def apply_delta(model, name: str):
    from peft import PeftModel

    from orchestra.family.train import DELTAS_DIR

    delta_dir = DELTAS_DIR / name
    if not (delta_dir / "adapter_model.safetensors").is_file() or not (delta_dir / "adapter_config.json").is_file():
        raise FamilyBuildError(
            f"the {name!r} delta is missing from {delta_dir}; reinstall orchestra or reproduce it with "
            f"`orchestra family train-delta {name}`"
        )
    try:
        merged = PeftModel.from_pretrained(model, str(delta_dir), is_trainable=False).merge_and_unload()
    except Exception as exc:
        raise FamilyBuildError(f"the {name!r} delta in {delta_dir} does not fit the model: {exc}") from exc
    return merged
