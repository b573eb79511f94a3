"""Pair compatibility: may this source's KV be carried into this target, and what must be bridged?

Tokenizers that give other token ids are refused (same text must give the same ids, or the positions
of the two caches mean different things); what never changes ids (eos/pad roles, chat template) may
differ and is noted on the card (`mappings.tokenizer_compat`). Everything a map can bridge — RoPE base
or scaling, KV-head count, head size, depth, dtype — is listed on the :class:`PairCard` and handled by
the fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from mappings.errors import TokenizerMismatchError
from mappings.tokenizer_compat import compare_tokenizers, first_difference

if TYPE_CHECKING:
    from mappings.types import JSONDict, Model, ModelConfig, Tokenizer

__all__ = ["ModelCard", "PairCard", "check_pair", "compare_tokenizers", "model_card", "PROBE_TEXT"]

PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. def parse(line):\n    return [int(x) for x in "
    "line.split(',')]  # 1234567890 ÄÖÜ ß 日本語 — “quotes” <tag> & co."
)


@dataclass(frozen=True)
class ModelCard:
    """The facts about one model that decide how its cache is laid out."""

    name: str
    """Path or class name."""
    model_type: str
    """transformers model_type (llama, qwen2, ...)."""
    num_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads."""
    head_dim: int
    """Head size."""
    hidden_size: int
    """Residual width."""
    vocab_size: int
    """Embedding rows."""
    max_positions: int | None
    """Maximum positions (max_position_embeddings)."""
    rope: JSONDict
    """RoPE type and parameters."""
    dtype: str
    """Parameter dtype."""


def model_card(model_or_config: Model | ModelConfig, name: str | None = None) -> ModelCard:
    """Describe a model (or a bare config)."""
    import torch

    from mappings.capture import kv_shape
    from mappings.rope import RopeSpec

    model: Model | None
    config: ModelConfig
    if isinstance(model_or_config, torch.nn.Module):
        model, config = model_or_config, model_or_config.config
    else:
        model, config = None, model_or_config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    shape = kv_shape(config)
    if model is not None:
        from mappings.cache_io import model_dtype

        dtype = str(model_dtype(model)).replace("torch.", "")
    else:
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32").replace("torch.", "")
    rope = RopeSpec.from_config(config)
    return ModelCard(
        name=name or str(getattr(config, "_name_or_path", "") or type(model_or_config).__name__),
        model_type=str(getattr(config, "model_type", "?")),
        num_layers=shape.num_layers,
        num_attention_heads=int(config.num_attention_heads),
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        hidden_size=int(config.hidden_size),
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        max_positions=getattr(config, "max_position_embeddings", None),
        rope=rope.describe(),
        dtype=dtype,
    )


@dataclass
class PairCard:
    """What a source→target pair shares and what a map has to bridge."""

    source: ModelCard
    """The model whose cache is carried."""
    target: ModelCard
    """The model that receives it."""
    tokenizer: str = "identical"
    """Tokenizer verdict (only tokenizers giving the same token ids get a card) and any harmless differences."""
    differences: list[str] = field(default_factory=list)
    """Bridgeable differences, one line each."""

    @property
    def same_kv_heads(self) -> bool:
        return self.source.kv_heads == self.target.kv_heads

    @property
    def same_kv_shape(self) -> bool:
        """Equal KV heads and head size per layer (depth may still differ)."""
        return self.same_kv_heads and self.source.head_dim == self.target.head_dim

    @property
    def same_depth(self) -> bool:
        return self.source.num_layers == self.target.num_layers

    @property
    def same_rope(self) -> bool:
        return self.source.rope == self.target.rope

    @property
    def identical_layout(self) -> bool:
        """Source KV could be reused unchanged (same depth, heads, head size)."""
        return self.same_kv_shape and self.same_depth

    def as_dict(self) -> dict[str, object]:
        return {"source": asdict(self.source), "target": asdict(self.target), "tokenizer": self.tokenizer,
                "differences": list(self.differences)}

    def render(self) -> str:
        """A readable multi-line card."""
        rows = [
            ("model", self.source.name, self.target.name),
            ("type", self.source.model_type, self.target.model_type),
            ("layers", self.source.num_layers, self.target.num_layers),
            ("q heads", self.source.num_attention_heads, self.target.num_attention_heads),
            ("kv heads", self.source.kv_heads, self.target.kv_heads),
            ("head dim", self.source.head_dim, self.target.head_dim),
            ("hidden", self.source.hidden_size, self.target.hidden_size),
            ("rope", _rope_text(self.source.rope), _rope_text(self.target.rope)),
            ("max positions", self.source.max_positions, self.target.max_positions),
            ("dtype", self.source.dtype, self.target.dtype),
        ]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(str(r[1])) for r in rows)
        lines = ["pair card", f"  {'':{w0}}  {'source':{w1}}  target"]
        for label, a, b in rows:
            mark = "" if a == b or label == "model" else "   <- differs"
            lines.append(f"  {label:{w0}}  {a!s:{w1}}  {b}{mark}")
        lines.append(f"  tokenizer: {self.tokenizer}")
        if self.differences:
            lines.append("  bridged by the map:")
            lines.extend(f"    - {d}" for d in self.differences)
        else:
            lines.append("  no differences to bridge")
        return "\n".join(lines)


def _rope_text(rope: JSONDict) -> str:
    if rope.get("rope_type") == "none":
        return "none"
    extra = {k: v for k, v in rope.items() if k not in {"rope_type", "rope_theta", "head_dim"}}
    text = f"{rope.get('rope_type')} θ={rope.get('rope_theta')}"
    return text + (f" {extra}" if extra else "")


def check_pair(
    source: Model | ModelConfig,
    source_tokenizer: Tokenizer,
    target: Model | ModelConfig,
    target_tokenizer: Tokenizer,
    *,
    source_name: str | None = None,
    target_name: str | None = None,
    probe_text: str = PROBE_TEXT,
) -> PairCard:
    """Compare a pair; raises :class:`TokenizerMismatchError` naming what differs when the tokenizers give other ids.

    Special-token roles and chat templates may differ (a base model and its instruct sibling): they
    never change the ids of a text, so they are only noted in the card's tokenizer verdict.
    """
    diff = compare_tokenizers(target_tokenizer, source_tokenizer, names=("the target", "the source"))
    if not diff.same_ids:
        raise TokenizerMismatchError(diff.refusal("the target") + ", so their caches cannot be mapped: pick two "
                                     "models of one family")
    # Same rules, so the same ids; encoding a probe still checks what the rules cannot show (a slow
    # tokenizer's code) and anything the backend adds at encoding time.
    ia = list(source_tokenizer(probe_text, add_special_tokens=False)["input_ids"])
    ib = list(target_tokenizer(probe_text, add_special_tokens=False)["input_ids"])
    first = first_difference(ib, ia)
    if first is not None:
        raise TokenizerMismatchError(
            f"the target's tokenizer differs from the source's: the probe text tokenizes differently ({len(ib)} vs "
            f"{len(ia)} ids, first difference at token {first}) — members of one family must share a tokenizer, "
            "so their caches cannot be mapped: pick two models of one family"
        )
    verdict = "same token ids (vocabulary, merges, normalizer, pre-tokenizer, added tokens, probe ids)"
    if diff.notes:
        verdict += "; harmless: " + "; ".join(diff.notes)
    s, t = model_card(source, source_name), model_card(target, target_name)
    diffs = []
    if s.num_layers != t.num_layers:
        diffs.append(f"depth {s.num_layers} -> {t.num_layers} layers: each target layer is fed by its best source layers")
    if s.kv_heads != t.kv_heads:
        diffs.append(f"KV heads {s.kv_heads} -> {t.kv_heads}: per-layer maps over all heads")
    if s.head_dim != t.head_dim:
        diffs.append(f"head size {s.head_dim} -> {t.head_dim}: per-layer maps over all heads")
    if s.rope != t.rope:
        diffs.append(f"RoPE {_rope_text(s.rope)} -> {_rope_text(t.rope)}: keys mapped with RoPE stripped, target RoPE re-applied")
    if s.dtype != t.dtype:
        diffs.append(f"dtype {s.dtype} -> {t.dtype}: fitted in fp32, cast to the target dtype")
    if s.max_positions != t.max_positions:
        diffs.append(f"max positions {s.max_positions} -> {t.max_positions}: documents must fit the target")
    return PairCard(s, t, verdict, diffs)
