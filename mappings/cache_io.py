"""The project's one Hugging Face glue module: caches, forward passes, device and dtype.

Everything that touches a transformers cache object or a model's forward signature goes through
here, for ``mappings`` and ``agents`` alike (and ``orchestra`` through them), so there is one rule
for each question instead of one per package:

- reading a cache: :func:`cache_layers`, :func:`cache_length`, :func:`slice_layers`;
- making one: :func:`new_cache` (empty, for a model), :func:`build_cache` (from per-layer tensors),
  :func:`truncate_cache` (a prefix, as views), :func:`copy_cache` (a private deep copy for a model);
- running one: :func:`forward_with_cache`, :func:`prefill`, :func:`cache_kwarg`;
- where a model lives: :func:`model_device`, :func:`model_dtype`; :func:`sync_device` for timings.

Supported cache forms:

- ``DynamicCache`` with ``.layers[i].keys/.values`` (transformers 4.56+ and 5.x);
- older ``DynamicCache`` with ``.key_cache`` / ``.value_cache`` lists;
- legacy tuples ``((k0, v0), (k1, v1), ...)``.

Every tensor is ``[batch, kv_heads, seq, head_dim]``. Models take the cache as ``cache=``
(transformers 5) or ``past_key_values=`` (transformers 4): :func:`cache_kwarg` finds out which.
torch and transformers are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import copy
import inspect
from typing import TYPE_CHECKING, Protocol, cast

from mappings.errors import ShapeMismatchError, UnsupportedModelError

if TYPE_CHECKING:
    import torch
    from transformers.utils import ModelOutput

    from mappings.types import CacheLike, DeviceLike, DType, KVCache, Model, ModelConfig, Module

__all__ = [
    "KVLayers",
    "cache_layers",
    "build_cache",
    "new_cache",
    "cache_kwarg",
    "cache_length",
    "slice_layers",
    "truncate_cache",
    "copy_cache",
    "forward_with_cache",
    "prefill",
    "model_device",
    "model_dtype",
    "sync_device",
    "ForwardOutputs",
]

KVLayers = list[tuple["torch.Tensor", "torch.Tensor"]]
"""Per-layer ``(keys, values)``, each ``[batch, kv_heads, seq, head_dim]``."""


class ForwardOutputs(Protocol):
    """The model's own output object, third in :func:`forward_with_cache`'s result (a ``ModelOutput``).

    ``hidden_states`` (the embeddings, then each layer's output, ``[batch, seq, hidden]``) is only
    filled when ``output_hidden_states=True`` was asked for; otherwise it is None.
    """

    @property
    def logits(self) -> torch.Tensor: ...

    @property
    def hidden_states(self) -> tuple[torch.Tensor, ...]: ...


class _ListCache(Protocol):
    """A transformers 4.x ``DynamicCache``: per-layer tensors in two lists."""

    key_cache: list[torch.Tensor]
    value_cache: list[torch.Tensor]


def cache_layers(cache: CacheLike) -> KVLayers:
    """Per-layer ``(K, V)`` of a cache in any supported form (tensors are not copied)."""
    if cache is None:
        raise ShapeMismatchError("no cache given: run the model with use_cache=True first")
    layers = getattr(cache, "layers", None)
    if layers is not None and not isinstance(cache, (tuple, list)):
        out: KVLayers = []
        for i, layer in enumerate(layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.numel() == 0:
                raise ShapeMismatchError(
                    f"cache layer {i} ({type(layer).__name__}) holds no keys/values; "
                    "fill the cache with a prefill before reading it"
                )
            out.append((keys, values))
        return out
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    if isinstance(cache, (tuple, list)):
        out = []
        for i, item in enumerate(cache):
            if not isinstance(item, (tuple, list)) or len(item) < 2:
                raise ShapeMismatchError(f"legacy cache entry {i} is not a (key, value) pair")
            out.append((item[0], item[1]))
        return out
    raise UnsupportedModelError(
        f"cannot read keys/values from a {type(cache).__name__}; pass a DynamicCache or legacy tuples"
    )


def cache_length(cache: CacheLike) -> int:
    """Number of cached positions."""
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    layers = cache_layers(cache)
    return int(layers[0][0].shape[-2]) if layers else 0


def slice_layers(layers: KVLayers, start: int = 0, stop: int | None = None) -> KVLayers:
    """The ``[start, stop)`` positions of every layer (views, no copy)."""
    return [(k[:, :, start:stop], v[:, :, start:stop]) for k, v in layers]


def build_cache(
    layers: KVLayers, config: ModelConfig | None = None, device: DeviceLike | None = None,
    dtype: DType | None = None,
) -> KVCache:
    """A fresh ``DynamicCache`` holding ``layers``, on ``device``/``dtype`` when given.

    With ``config`` the cache gets the model's own layer types (e.g. sliding-window layers).
    Plain full-attention layers take the tensors as they are (no copy; caches never modify
    their tensors in place); other layer types are filled through ``update``.
    """
    cache = _empty_cache(config)
    for i, (k, v) in enumerate(layers):
        k = k.to(device=device if device is not None else k.device, dtype=dtype if dtype is not None else k.dtype)
        v = v.to(device=device if device is not None else v.device, dtype=dtype if dtype is not None else v.dtype)
        if not _adopt(cache, i, k, v):
            cache.update(k, v, i)
    return cache


def _empty_cache(config: ModelConfig | None = None) -> KVCache:
    from transformers import DynamicCache

    if config is None:
        return DynamicCache()
    try:
        return DynamicCache(config=config)
    except TypeError:  # older transformers without config support
        return DynamicCache()


def new_cache(model: Model) -> KVCache:
    """An empty ``DynamicCache`` configured for ``model`` (its own layer types, e.g. sliding windows).

    What a prefill that the model will later continue should start from. :func:`forward_with_cache`
    with ``cache=None`` instead starts from a plain full-length cache, because capture and
    calibration need every position of every layer.
    """
    return _empty_cache(model.config)


def truncate_cache(cache: CacheLike, length: int, config: ModelConfig | None = None) -> KVCache:
    """A cache holding the first ``length`` positions of ``cache``: views, ``cache`` itself untouched.

    Works on every supported cache form and on transformers 4.x and 5.x alike (their
    ``DynamicCache.crop`` arguments differ, and ``crop`` would modify the cache in place). With
    ``config`` the result gets the model's layer types. Continuing the result never writes into
    ``cache``'s tensors (a forward pass concatenates into new ones). Raises
    :class:`ShapeMismatchError` when ``length`` is negative or beyond the cached positions.
    """
    held = cache_length(cache)
    if not 0 <= length <= held:
        raise ShapeMismatchError(f"cannot keep {length} positions of a cache holding {held}")
    return build_cache(slice_layers(cache_layers(cache), 0, length), config)


def _clone_cache(cache: CacheLike, device: torch.device, dtype: torch.dtype) -> KVCache | None:
    """Copy the cache's structure shallowly and its tensors deeply (much faster than ``copy.deepcopy``).

    Keys and values go to ``device``/``dtype``; other state tensors (lengths, window sizes) are
    cloned where they are. None for a cache form this does not know.
    """
    import torch

    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype, copy=True)

    layers = getattr(cache, "layers", None)
    if layers is not None and not isinstance(cache, (tuple, list)):  # transformers 5.x: one object per layer
        fresh = copy.copy(cache)
        fresh.layers = []
        for layer in layers:
            twin = copy.copy(layer)
            for name, value in vars(layer).items():  # keys, values and any other state tensors
                if isinstance(value, torch.Tensor):
                    setattr(twin, name, clone(value) if name in ("keys", "values") else value.clone())
            if isinstance(getattr(layer, "keys", None), torch.Tensor):
                if hasattr(twin, "device"):
                    twin.device = device
                if isinstance(getattr(twin, "dtype", None), torch.dtype):
                    twin.dtype = dtype
            fresh.layers.append(twin)
        return fresh
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):  # transformers 4.x
        lists = cast("_ListCache", cache)
        twin_cache = copy.copy(lists)
        twin_cache.key_cache = [clone(k) for k in lists.key_cache]
        twin_cache.value_cache = [clone(v) for v in lists.value_cache]
        return cast("KVCache", twin_cache)
    return None


def copy_cache(cache: CacheLike, model: Module) -> KVCache:
    """A private deep copy of ``cache`` on ``model``'s device and dtype; ``cache`` is never modified.

    One document cache serves many agents (and threads) at once, so whoever extends a cache
    extends a copy. Cache objects keep their class (structure copied shallowly, tensors deeply:
    much faster than ``copy.deepcopy``); legacy tuples come back as a ``DynamicCache`` for the
    model, the form current models accept. Raises :class:`UnsupportedModelError` for an unknown
    cache class that cannot be moved to the model's device/dtype.
    """
    device, dtype = model_device(model), model_dtype(model)
    if isinstance(cache, (tuple, list)):
        layers = [(k.to(device=device, dtype=dtype, copy=True), v.to(device=device, dtype=dtype, copy=True))
                  for k, v in cache_layers(cache)]
        return build_cache(layers, getattr(model, "config", None))
    fresh = _clone_cache(cache, device, dtype)
    if fresh is not None:
        return fresh
    fresh = copy.deepcopy(cache)  # an unknown cache class: copy everything
    if any(k.device != device or k.dtype != dtype for k, _ in cache_layers(fresh)):
        raise UnsupportedModelError(
            f"cannot move a {type(cache).__name__} to {device}/{dtype}; pass a DynamicCache"
        )
    return fresh


def _adopt(cache: KVCache, index: int, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Hand ``k``/``v`` to an empty full-attention ``DynamicLayer`` without the copy ``update`` makes."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # transformers without per-layer cache objects
        return False
    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers):
        return False
    layer = layers[index]
    if type(layer) is not DynamicLayer or getattr(layer, "is_initialized", True):
        return False
    layer.lazy_initialization(k, v)
    layer.keys, layer.values = k, v
    return True


# A plain dict rather than functools.cache: mypy does not accept class objects as its Hashable arguments.
_FORWARD_PARAMS: dict[type[torch.nn.Module], frozenset[str]] = {}


def _forward_params(cls: type[torch.nn.Module]) -> frozenset[str]:
    """Parameter names of ``cls.forward``, once per class (signature inspection is slow per token)."""
    params = _FORWARD_PARAMS.get(cls)
    if params is None:
        params = _FORWARD_PARAMS[cls] = frozenset(inspect.signature(cls.forward).parameters)
    return params


def cache_kwarg(model: torch.nn.Module) -> str:
    """``"cache"`` when the model's forward takes ``cache=`` (transformers 5), else ``"past_key_values"``.

    Works on whole models and on single decoder layers; looked up once per class.
    """
    return "cache" if "cache" in _forward_params(type(model)) else "past_key_values"


def _logits_kwargs(model: torch.nn.Module, keep: int | None) -> dict[str, int]:
    """The keyword asking for only the last ``keep`` positions' logits, in the spelling the model takes."""
    if keep is None:
        return {}
    params = _forward_params(type(model))
    if "logits_to_keep" in params:
        return {"logits_to_keep": keep}
    if "num_logits_to_keep" in params:  # transformers 4.4x
        return {"num_logits_to_keep": keep}
    return {}


def _output_cache(out: ModelOutput) -> KVCache | None:
    keys = set(out.keys()) if hasattr(out, "keys") else set()
    for name in ("cache", "past_key_values"):
        if name in keys and out[name] is not None:
            return out[name]
    return getattr(out, "cache", None)


def model_device(model: Module) -> torch.device:
    """The device of the model's first parameter: where inputs and caches for it must go."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        raise UnsupportedModelError(f"{type(model).__name__} has no parameters: cannot tell its device") from None


def model_dtype(model: Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 when it has none).

    The one rule for the whole project: quantized members keep integer weights next to float
    ones, so "the first parameter" could be an int8 tensor, while caches and hidden states always
    take the float dtype the model computes in (what ``PreTrainedModel.dtype`` reports too).
    """
    import torch

    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def sync_device(device: str | torch.device) -> None:
    """Wait for queued CUDA work on ``device`` so a timing covers it; a no-op on any other device.

    Accepts ``"cuda:0"``-style strings and ``torch.device``; does not import torch for a CPU device.
    """
    kind = device.type if hasattr(device, "type") else str(device).split(":", 1)[0]
    if kind != "cuda":
        return
    import torch

    torch.cuda.synchronize(device)


def forward_with_cache(
    model: Module,
    input_ids: torch.Tensor,
    cache: CacheLike | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    output_hidden_states: bool = False,
    logits_to_keep: int | None = None,
) -> tuple[torch.Tensor, KVCache, ForwardOutputs]:
    """Run ``input_ids`` after ``cache`` (None: from scratch); returns ``(logits, cache, outputs)``.

    Positions continue after the cached prefix unless ``position_ids`` is given. An
    ``attention_mask``, when given, covers prefix plus new tokens (``[batch, past + new]``); a 4-D
    mask (``[batch, 1, new, past + new]``, additive) goes to the model as it is, with ``position_ids``.
    A fresh full-length ``DynamicCache`` is used when ``cache`` is None so every layer keeps all
    positions. A cache object is extended in place (legacy tuples are first rebuilt into a new
    one). ``logits_to_keep`` asks for the last positions' logits only (when the model supports it).
    Runs under ``torch.no_grad``.
    """
    import torch

    device = model_device(model)
    input_ids = input_ids.to(device)
    if cache is None:
        cache = _empty_cache()
    elif isinstance(cache, (tuple, list)):  # legacy tuples: models of transformers 5 want a Cache object
        cache = build_cache(cache_layers(cache))
    past = cache_length(cache)
    if position_ids is None:
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, past:]
        else:
            position_ids = torch.arange(past, past + input_ids.shape[1], device=device)[None].expand(
                input_ids.shape[0], -1
            )
    kwargs: dict[str, object] = {
        "input_ids": input_ids,
        "position_ids": position_ids.to(device),
        "use_cache": True,
        cache_kwarg(model): cache,
    }
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    kwargs.update(_logits_kwargs(model, logits_to_keep))
    with torch.no_grad():
        out = model(**kwargs)
    returned = _output_cache(out)
    return out.logits, (returned if returned is not None else cache), out


def prefill(
    model: Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, KVCache]:
    """Prefill ``input_ids`` from scratch; returns ``(logits, cache)``."""
    logits, cache, _ = forward_with_cache(model, input_ids, None, attention_mask=attention_mask)
    return logits, cache
