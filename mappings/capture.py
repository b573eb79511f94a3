"""Capture per-layer keys and values (fp32) from a Hugging Face causal LM.

Padding never leaves this module: a batch of sequences of different lengths is run with an
attention mask and position ids computed from it (left or right padding both work), and only
the valid positions come back, flattened to ``[tokens, kv_heads, head_dim]`` with their
positions, so a fit never sees a pad token. Keys come back as the model caches them (RoPE
applied); :mod:`mappings.rope` strips it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

from mappings.cache_io import cache_layers, forward_with_cache, model_device
from mappings.errors import CorpusTooSmallError, NonFiniteKVError, UnsupportedModelError

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

    from mappings.cache_io import KVLayers
    from mappings.types import Model, ModelConfig, Module, Tokenizer

__all__ = [
    "KVCapture",
    "capture_kv",
    "capture_texts",
    "capture_windows",
    "capture_queries",
    "make_windows",
    "decoder_layers",
    "kv_shape",
    "kv_token_bytes",
    "KVShape",
]


@dataclass(frozen=True)
class KVShape:
    """The cache layout of a model."""

    num_layers: int
    """Decoder layers (one K and one V per layer)."""
    kv_heads: int
    """Key/value heads per layer."""
    head_dim: int
    """Size of one head."""

    @property
    def width(self) -> int:
        """Features per token per layer (``kv_heads * head_dim``)."""
        return self.kv_heads * self.head_dim

    def as_dict(self) -> dict[str, int]:
        return {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim}


def _decoder_config(config: ModelConfig) -> ModelConfig:
    """The decoder's part of a config (a multimodal one's text config; any other as it is)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def kv_shape(config: ModelConfig) -> KVShape:
    """The cache layout a config implies."""
    from mappings.rope import head_dim_of

    config = _decoder_config(config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KVShape(int(config.num_hidden_layers), int(heads), head_dim_of(config))


def query_groups(config: ModelConfig) -> int:
    """Query heads per key/value head (grouped-query attention; 1 without it)."""
    shape = kv_shape(config)
    return max(1, int(getattr(_decoder_config(config), "num_attention_heads", shape.kv_heads)) // shape.kv_heads)


def kv_token_bytes(config: ModelConfig | Mapping[str, object], itemsize: int) -> int:
    """Bytes one token's keys and values take over every layer at `itemsize` bytes an element, for a model
    config or its config.json as read (a dict; a multimodal one's ``text_config`` part)."""
    if isinstance(config, Mapping):
        text = config.get("text_config") or config
        config = cast("ModelConfig", SimpleNamespace(**dict(cast("Mapping[str, object]", text))))
    shape = kv_shape(config)
    return 2 * shape.num_layers * shape.width * itemsize


@dataclass
class KVCapture:
    """Keys/values of the valid (non-pad) tokens of one batch, per layer, fp32."""

    keys: list[torch.Tensor]
    """Per layer ``[tokens, kv_heads, head_dim]``, RoPE applied (as cached)."""
    values: list[torch.Tensor]
    """Per layer ``[tokens, kv_heads, head_dim]``."""
    positions: torch.Tensor
    """``[tokens]`` position id of every captured token."""
    rows: torch.Tensor
    """``[tokens]`` batch row each token came from."""
    lengths: list[int]
    """Valid tokens per batch row."""
    hidden: list[torch.Tensor] | None = None
    """Per layer ``[tokens, hidden]``: the residual stream entering that layer (if asked for)."""
    queries: list[torch.Tensor] | None = None
    """Per layer ``[tokens, q_heads, head_dim]`` with RoPE applied (if asked for)."""
    logits: torch.Tensor | None = None
    """``[tokens, vocab]`` next-token logits of the valid tokens (if asked for)."""

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    def dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` of one layer as ``[batch, kv_heads, max_len, head_dim]``, right-padded with zeros."""
        import torch

        k, v = self.keys[layer], self.values[layer]
        batch, width = len(self.lengths), max(self.lengths)
        out_k = k.new_zeros(batch, width, *k.shape[1:])
        out_v = v.new_zeros(batch, width, *v.shape[1:])
        offsets = torch.cat([torch.arange(n) for n in self.lengths]).to(k.device)
        out_k[self.rows, offsets] = k
        out_v[self.rows, offsets] = v
        return out_k.transpose(1, 2), out_v.transpose(1, 2)

    def dense_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.dense(i) for i in range(self.num_layers)]


def decoder_layers(model: Module) -> Sequence[Module]:
    """The decoder layer modules of a causal LM."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers"):
        obj: object = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return cast("Sequence[Module]", obj)  # an nn.ModuleList
    get_decoder = getattr(model, "get_decoder", None)
    if get_decoder is not None:
        return cast("Sequence[Module]", get_decoder().layers)
    raise UnsupportedModelError(f"cannot find the decoder layers of {type(model).__name__}")


@contextmanager
def capture_queries(model: Module) -> Iterator[dict[int, torch.Tensor]]:
    """Record every decoder layer's queries during the forward passes run inside the block.

    Yields a dict that forward hooks fill: layer index -> the output of that layer's
    ``self_attn.q_norm`` (models that normalise queries) or ``self_attn.q_proj``, detached, from the
    last forward pass; reshape it to ``[batch, seq, q_heads, head_dim]``. RoPE is not applied yet
    (:class:`~mappings.rope.RopeSpec` does that). Queries are what the attention metrics and the
    repair planner's token ranking need, and the model does not return them, hence the hooks; they
    are removed when the block exits, also on error. Raises :class:`UnsupportedModelError` (with no
    hook left behind) when a layer has no query projection.

        with capture_queries(model) as queries:
            model(input_ids=ids)
        q0 = queries[0]
    """
    store: dict[int, torch.Tensor] = {}
    handles: list[RemovableHandle] = []
    try:
        for i, layer in enumerate(decoder_layers(model)):
            attn = getattr(layer, "self_attn", None)
            target = getattr(attn, "q_norm", None) or getattr(attn, "q_proj", None)
            if target is None:
                raise UnsupportedModelError(
                    f"layer {i} of {type(model).__name__} has no self_attn.q_proj; queries cannot be captured"
                )

            def hook(_module: Module, _inputs: tuple[object, ...], output: torch.Tensor, i: int = i) -> None:
                store[i] = output.detach()

            handles.append(target.register_forward_hook(hook))
        yield store
    finally:
        for h in handles:
            h.remove()


def _check_finite(name: str, layer: int, t: torch.Tensor) -> None:
    import torch

    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise NonFiniteKVError(
            f"{name} of layer {layer} hold {int(bad.sum())} NaN/inf values at valid positions; "
            "the model overflows on this input: load it in float32 or bfloat16 instead of float16, "
            "or check its weights"
        )


def capture_kv(
    model: Model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    hidden_states: bool = False,
    queries: bool = False,
    logits: bool = False,
    check_finite: bool = True,
) -> KVCapture:
    """Run ``input_ids`` ``[batch, seq]`` and return K/V (fp32) of the valid positions only.

    ``attention_mask`` marks valid tokens (1) and padding (0), left or right. Raises
    :class:`NonFiniteKVError` when a valid position holds NaN/inf.
    """
    batch = _padded_batch(model, input_ids, attention_mask)
    valid = batch.valid
    hooks: AbstractContextManager[dict[int, torch.Tensor]] = capture_queries(model) if queries else nullcontext({})
    with hooks as store:
        out_logits, cache, out = forward_with_cache(
            model, batch.ids, None, attention_mask=batch.mask, position_ids=batch.positions,
            output_hidden_states=hidden_states, logits_to_keep=None if logits else 1,
        )
    layers = cache_layers(cache)
    keys, values = _valid_kv(layers, batch, check_finite)
    rows = valid.nonzero()[:, 0]
    capture = KVCapture(
        keys=keys,
        values=values,
        positions=batch.positions[valid],
        rows=rows,
        lengths=[int(n) for n in valid.sum(-1).tolist()],
    )
    if hidden_states:
        capture.hidden = [h[valid].float() for h in out.hidden_states[: len(layers)]]
    if queries:
        capture.queries = _valid_queries(model, store, batch, len(layers))
    if logits:
        capture.logits = out_logits[valid].float()
    return capture


@dataclass(frozen=True)
class _Batch:
    """A batch ready to run: ids and mask on the model's device, where its tokens are, their positions."""

    ids: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    """``[batch, seq]`` bool: True where a token is, False on padding."""
    positions: torch.Tensor
    """``[batch, seq]`` position ids counted over each row's tokens (0 on leading padding)."""

    @property
    def seq(self) -> int:
        """Positions per row, padding included."""
        return int(self.ids.shape[1])


def _padded_batch(model: Model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> _Batch:
    """``input_ids`` (a sequence or a padded batch) on ``model``'s device, with its mask and position ids."""
    import torch

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    device = model_device(model)
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device)
    valid = attention_mask.bool()
    if not bool(valid.any()):
        raise CorpusTooSmallError("nothing to capture: every position of the batch is padding")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    return _Batch(input_ids, attention_mask, valid, position_ids)


def _valid_kv(layers: KVLayers, batch: _Batch,
              check_finite: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's keys and values at the batch's token positions, ``[tokens, kv_heads, head_dim]`` fp32."""
    seq = batch.seq
    keys, values = [], []
    for i, (k, v) in enumerate(layers):
        if k.shape[-2] != seq:
            raise UnsupportedModelError(
                f"layer {i} cached {k.shape[-2]} of {seq} positions (a sliding-window or compressed cache); "
                "capture needs every position: use shorter windows than the sliding window"
            )
        kk = k.transpose(1, 2)[batch.valid].float()
        vv = v.transpose(1, 2)[batch.valid].float()
        if check_finite:
            _check_finite("keys", i, kk)
            _check_finite("values", i, vv)
        keys.append(kk)
        values.append(vv)
    return keys, values


def _valid_queries(model: Model, store: Mapping[int, torch.Tensor], batch: _Batch,
                   count: int) -> list[torch.Tensor]:
    """The first ``count`` layers' captured queries, RoPE applied, at the batch's token positions (fp32)."""
    from mappings.rope import RopeSpec

    rope = RopeSpec.from_config(model.config)
    seq = batch.seq
    qs = []
    heads = model.config.num_attention_heads
    for i in range(count):
        q = store[i].reshape(batch.ids.shape[0], seq, heads, -1).float()
        q = rope.apply(q.transpose(1, 2), batch.positions, seq_len=seq).transpose(1, 2)
        qs.append(q[batch.valid])
    return qs


def capture_texts(
    model: Model, tokenizer: Tokenizer, texts: Sequence[str], *, padding_side: str = "right", **kwargs: bool
) -> KVCapture:
    """Tokenize ``texts`` (no special tokens), pad them into one batch and capture."""
    if not texts:
        raise CorpusTooSmallError("no texts to capture")
    old_side = getattr(tokenizer, "padding_side", "right")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    try:
        enc = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = old_side
    return capture_kv(model, enc["input_ids"], enc["attention_mask"], **kwargs)


def make_windows(ids: Sequence[int] | torch.Tensor, window: int, stride: int | None = None) -> list[torch.Tensor]:
    """Cut a token sequence into full windows of ``window`` tokens (the tail shorter than a window is dropped)."""
    import torch

    ids = torch.as_tensor(ids, dtype=torch.long)
    stride = stride or window
    return [ids[s : s + window] for s in range(0, max(0, ids.numel() - window + 1), stride)]


def capture_windows(
    model: Model,
    windows: Sequence[torch.Tensor],
    *,
    batch_size: int = 4,
    progress: bool = True,
    desc: str = "capturing",
    hidden_states: bool = False,
    queries: bool = False,
    logits: bool = False,
    check_finite: bool = True,
) -> Iterator[KVCapture]:
    """Capture equal-length token windows batch by batch (a tqdm bar when ``progress``); the flags are
    :func:`capture_kv`'s."""
    import torch
    from tqdm.auto import tqdm

    bar = tqdm(total=len(windows), desc=desc, unit="win", disable=not progress)
    try:
        for start in range(0, len(windows), batch_size):
            batch = torch.stack(list(windows[start : start + batch_size]))
            yield capture_kv(model, batch, hidden_states=hidden_states, queries=queries, logits=logits,
                             check_finite=check_finite)
            bar.update(batch.shape[0])
    finally:
        bar.close()
