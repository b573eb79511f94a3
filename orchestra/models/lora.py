"""LoRA adapters applied at run time over a base model whose weights are held once (no peft needed to run).

An adapter member is its own module tree: :func:`attach_lora` deep-copies the base's modules with every
parameter and buffer *shared* (the same tensor objects), then wraps each adapted ``Linear`` of the copy
in a :class:`LoraLinear` holding the adapter's factors. So the base and each adapter are independent
modules (hooks, forward passes and caches of one never see the other; there is no "active adapter" to
switch), while the base's weights exist once. Forward passes on a base and its adapters share one lock
(`orchestra.models.registry`).

What runs is plain LoRA as peft computes it at inference: ``y = W x + (B (A x)) * scaling`` with
``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), per-module ``rank_pattern`` /
``alpha_pattern``, factors kept in float32 (peft upcasts low-precision adapter weights the same way).
An adapter that needs more (DoRA, bias terms, ``modules_to_save``, embedding or convolution adapters, an
initialisation that rewrites the base such as PiSSA) is refused with a typed `AdapterError` saying what
to do, never applied approximately.

`LoraLayout.untouched_layers` reads from the tensors' names how many leading decoder layers keep the
base's K/V exactly: the mapping store passes those layers through instead of fitting them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestra.errors import AdapterError

if TYPE_CHECKING:
    from mappings.types import Model

__all__ = ["LoraModule", "LoraLayout", "attach_lora"]

_PREFIX = "base_model.model."
_FACTORS = (".lora_A.weight", ".lora_B.weight")
# a decoder layer's index in a module path (model.layers.3.self_attn.q_proj, transformer.h.3.attn.c_attn)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")
# adapter_config.json keys that do not change what a plain Linear LoRA computes at inference (or are checked
# apart: bias, init_lora_weights, peft_type); any other key set to a value is a feature not applied here
_INERT_KEYS = {
    "alpha_pattern", "rank_pattern", "auto_mapping", "base_model_name_or_path", "bias", "exclude_modules",
    "inference_mode", "init_lora_weights", "layers_pattern", "layers_to_transform", "target_modules", "lora_alpha",
    "lora_dropout", "peft_type", "peft_version", "r", "revision", "task_type", "use_rslora", "loftq_config",
    "corda_config", "eva_config", "lora_ga_config", "megatron_core", "qalora_group_size", "ensure_weight_tying",
}
# initialisations that leave the base weights as they were (others rewrite them: the adapter needs that base)
_PLAIN_INITS = (True, False, "gaussian")


def _refuse(folder: Path, what: str) -> AdapterError:
    return AdapterError(f"adapter {folder}: {what}; merge it into a full model (peft's merge_and_unload, then "
                        "save_pretrained) and declare that folder instead")


def _check_config(folder: Path, config: dict[str, object]) -> None:
    """Refuse what is not plain LoRA on Linear layers, naming the setting."""
    if config.get("peft_type") != "LORA":
        raise _refuse(folder, f"it is a {config.get('peft_type')!r} adapter, and only LoRA adapters are members")
    if config.get("bias", "none") != "none":
        raise _refuse(folder, f"it trains bias terms (bias: {config.get('bias')!r})")
    if config.get("init_lora_weights", True) not in _PLAIN_INITS:
        raise _refuse(folder, f"its initialisation {config.get('init_lora_weights')!r} rewrites the base weights")
    for key, value in sorted(config.items()):
        if key not in _INERT_KEYS and value not in (None, False, {}, [], ""):
            raise _refuse(folder, f"it sets {key} ({value!r}), which the runtime does not apply")


def _number(value: object, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _pattern_value(patterns: object, module: str, default: float) -> float:
    """peft's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key that ends `module` at a dot boundary."""
    if isinstance(patterns, dict):
        for key, value in patterns.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return _number(value, default)
    return default


@dataclass(frozen=True)
class LoraModule:
    """One adapted Linear layer."""

    path: str
    """Its module path in the transformers model (``model.layers.3.self_attn.q_proj``)."""
    rank: int
    """The adapter's rank there (rows of lora_A)."""
    scaling: float
    """What B(A x) is multiplied by: lora_alpha / rank (/ sqrt(rank) with use_rslora)."""
    numel: int
    """Numbers in its two factors (rank x in_features + out_features x rank)."""


@dataclass(frozen=True)
class LoraLayout:
    """What a saved LoRA adapter changes, from its config and its tensors' names and shapes (no tensor read)."""

    folder: Path
    """The adapter folder (adapter_config.json, adapter_model.safetensors)."""
    modules: tuple[LoraModule, ...]
    """Every adapted Linear layer, in path order."""

    @property
    def factor_bytes(self) -> int:
        """Memory the factors take once attached (float32)."""
        return 4 * sum(m.numel for m in self.modules)

    @classmethod
    def read(cls, folder: Path, config: dict[str, object]) -> LoraLayout:
        """The layout of the adapter in `folder` (`config`: its adapter_config.json), or `AdapterError`."""
        from safetensors import safe_open

        _check_config(folder, config)
        shapes: dict[str, list[int]] = {}
        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as sf:
            for key in sf.keys():
                shapes[key] = list(sf.get_slice(key).get_shape())
        paths = sorted({key[len(_PREFIX):-len(suffix)] for key in shapes for suffix in _FACTORS
                        if key.startswith(_PREFIX) and key.endswith(suffix)})
        known = {f"{_PREFIX}{p}{suffix}" for p in paths for suffix in _FACTORS}
        other, half = sorted(set(shapes) - known), sorted(known - set(shapes))
        if other:
            raise _refuse(folder, f"it holds tensors other than Linear LoRA factors ({other[0]}, ...)")
        if half:
            raise AdapterError(f"adapter {folder}: {half[0]} is missing (each LoRA module has an A and a B "
                               "factor): the adapter file is incomplete; save it again")
        if not paths:
            raise _refuse(folder, "it holds no LoRA factors")
        r, alpha = _number(config.get("r"), 8), _number(config.get("lora_alpha"), 8)  # peft's defaults
        modules = []
        for path in paths:
            a, b = shapes[f"{_PREFIX}{path}.lora_A.weight"], shapes[f"{_PREFIX}{path}.lora_B.weight"]
            rank = int(_pattern_value(config.get("rank_pattern"), path, r))
            if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
                raise AdapterError(f"adapter {folder}: the factors of {path} ({a}, {b}) do not have rank {rank} as "
                                   "its adapter_config.json says: the files do not belong together")
            scale = _pattern_value(config.get("alpha_pattern"), path, alpha)
            scaling = scale / (math.sqrt(rank) if config.get("use_rslora") else rank)
            modules.append(LoraModule(path, rank, scaling, a[0] * a[1] + b[0] * b[1]))
        return cls(folder, tuple(modules))

    def untouched_layers(self, num_layers: int) -> int:
        """How many leading decoder layers keep the base's K/V exactly (every layer below the first one adapted).

        An adapted output head (``lm_head``) changes no K/V; any other module outside the decoder layers
        (or one whose layer cannot be told) counts as changing them all.
        """
        first = num_layers
        for module in self.modules:
            match = _LAYER.search(module.path)
            if match is not None:
                first = min(first, int(match[1]))
            elif module.path.rsplit(".", 1)[-1] != "lm_head":
                return 0
        return first


def attach_lora(base: Model, layout: LoraLayout) -> Model:
    """A new model tree over `base`'s own parameters and buffers with the adapter's LoRA layers in place.

    `base` is not changed: every module is copied, every tensor shared. Its factors go on the base's device
    in float32. Raises `AdapterError` when an adapted module is not a ``torch.nn.Linear`` or its size
    does not match the factors (the adapter was trained on another model).
    """
    import copy

    import torch
    from safetensors.torch import load_file

    from orchestra.models._lora_layer import LoraLinear

    shared: dict[int, object] = {id(t): t for t in (*base.parameters(), *base.buffers())}
    model = copy.deepcopy(base, memo=shared)
    device = next(base.parameters()).device
    factors = load_file(str(layout.folder / "adapter_model.safetensors"), device=str(device))
    for module in layout.modules:
        try:
            linear = model.get_submodule(module.path)
        except AttributeError as exc:
            raise AdapterError(f"adapter {layout.folder}: its base has no module {module.path}: it was trained "
                               "on another model; give it the base it was trained on") from exc
        a = factors[f"{_PREFIX}{module.path}.lora_A.weight"].to(torch.float32)
        b = factors[f"{_PREFIX}{module.path}.lora_B.weight"].to(torch.float32)
        if not isinstance(linear, torch.nn.Linear):
            raise _refuse(layout.folder, f"it adapts {module.path}, a {type(linear).__name__}, not a Linear layer")
        if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
            raise AdapterError(f"adapter {layout.folder}: {module.path} is {linear.in_features} -> "
                               f"{linear.out_features} in the base, the adapter's factors are {a.shape[1]} -> "
                               f"{b.shape[0]}: it was trained on another model; give it the base it was trained on")
        parent_path, _, name = module.path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, LoraLinear(linear, a, b, module.scaling))
    return model.eval()
