"""Type aliases for the objects every package passes around: models, tokenizers, caches, tensors, JSON.

    from mappings.types import KVCache, Model, Tensor, Tokenizer

    def prefill(model: Model, input_ids: Tensor) -> KVCache: ...

Importing this module is cheap: torch and transformers are imported for type checkers only, and at
run time each alias below is the string naming its type (a forward reference), so the aliases belong in
annotations (with ``from __future__ import annotations``), not in ``isinstance`` checks, pydantic fields
or typer signatures, which evaluate annotations at run time. The JSON aliases are real ``typing`` forms.

- :data:`Tensor`, :data:`Device`, :data:`DType`: ``torch.Tensor``, ``torch.device``, ``torch.dtype``;
  :data:`DeviceLike`: a device or its name (``"cuda:0"``).
- :data:`Module`: any ``torch.nn.Module`` (a whole model or one decoder layer);
  :data:`Model`: a Hugging Face causal LM, ``transformers.PreTrainedModel``;
  :data:`ModelConfig`: its ``transformers.PretrainedConfig``.
- :data:`Tokenizer`: ``transformers.PreTrainedTokenizerBase`` (slow and fast tokenizers alike).
- :data:`KVCache`: a transformers ``Cache`` (in practice a ``DynamicCache``: ``cache.layers[i].keys`` and
  ``.values``, each ``[batch, kv_heads, seq, head_dim]``); :data:`LegacyCache`: the old
  ``((k0, v0), (k1, v1), ...)`` form; :data:`CacheLike`: either, what :mod:`mappings.cache_io` reads.
- :data:`JSONValue`, :data:`JSONDict`: a value that ``json.dumps`` takes as it is (events, reports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
    from transformers.cache_utils import Cache

__all__ = [
    "Tensor",
    "Device",
    "DeviceLike",
    "DType",
    "Module",
    "Model",
    "ModelConfig",
    "Tokenizer",
    "KVCache",
    "LegacyCache",
    "CacheLike",
    "JSONScalar",
    "JSONValue",
    "JSONDict",
]

Tensor: TypeAlias = "torch.Tensor"
"""A torch tensor."""

Device: TypeAlias = "torch.device"
"""A torch device."""

DeviceLike: TypeAlias = "str | torch.device"
"""A torch device or its name, e.g. ``"cpu"`` or ``"cuda:0"``."""

DType: TypeAlias = "torch.dtype"
"""A torch dtype."""

Module: TypeAlias = "torch.nn.Module"
"""Any torch module: a whole model or one of its layers."""

Model: TypeAlias = "PreTrainedModel"
"""A Hugging Face causal language model (``transformers.PreTrainedModel``)."""

ModelConfig: TypeAlias = "PretrainedConfig"
"""A Hugging Face model configuration (``model.config``)."""

Tokenizer: TypeAlias = "PreTrainedTokenizerBase"
"""A Hugging Face tokenizer, slow or fast."""

KVCache: TypeAlias = "Cache"
"""A transformers KV cache object, in practice a ``DynamicCache`` (``.layers[i].keys/.values``)."""

LegacyCache: TypeAlias = "tuple[tuple[torch.Tensor, torch.Tensor], ...] | list[tuple[torch.Tensor, torch.Tensor]]"
"""Legacy per-layer ``(keys, values)`` pairs, ``((k0, v0), (k1, v1), ...)``."""

CacheLike: TypeAlias = "Cache | LegacyCache"
"""Any cache form :mod:`mappings.cache_io` reads: a cache object or legacy pairs."""

JSONScalar: TypeAlias = str | int | float | bool | None
"""A JSON scalar."""

JSONValue: TypeAlias = str | int | float | bool | None | list["JSONValue"] | dict[str, "JSONValue"]
"""Any JSON value (recursive)."""

JSONDict: TypeAlias = dict[str, JSONValue]
"""A JSON object."""
