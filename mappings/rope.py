"""Strip and re-apply rotary position embeddings (RoPE) on cached keys.

Keys in a KV cache already carry their position: ``k_rot = s * R(p) k`` where ``R(p)`` rotates
pairs of dimensions ``(i, i + d/2)`` by ``p * inv_freq[i]`` (the "rotate_half" layout every
Hugging Face Llama-style model uses) and ``s`` is the RoPE ``attention_scaling`` (1 except for
yarn/longrope). A map fitted on rotated keys would have to commute with every rotation; fitting
in *content space* (RoPE removed) does not, and it lets a pair whose RoPE base or scaling differs
be bridged: strip the source's rotation, map, apply the target's.

Frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn, longrope,
llama3, ...) called on the model's config, so every rope type transformers supports is handled
the same way the model handles it. Both config styles work: ``rope_parameters`` (transformers 5)
and ``rope_theta`` / ``rope_scaling`` (transformers 4).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mappings.errors import UnsupportedModelError

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from mappings.types import DeviceLike, JSONDict, JSONValue, ModelConfig

__all__ = ["RopeSpec", "RopeTables", "rope_parameters_of", "head_dim_of", "config_from_dict"]

# Rope types whose frequencies do not depend on the sequence length (cacheable per device).
_STATIC_TYPES = {"default", "linear", "llama3", "yarn", "proportional"}


def head_dim_of(config: ModelConfig) -> int:
    """The per-head size of a model config (``head_dim`` or ``hidden_size // num_attention_heads``)."""
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return int(config.hidden_size // config.num_attention_heads)


def rope_parameters_of(config: ModelConfig) -> dict[str, object] | None:
    """RoPE parameters of a config as one flat dict (``rope_type``, ``rope_theta``, scaling fields).

    Returns None for a model without rotary embeddings. Raises for per-layer-type RoPE (several
    rope dicts nested by attention type), which this package does not handle.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "rope_type" not in params and "rope_theta" not in params and "type" not in params:
            raise UnsupportedModelError(
                f"{type(config).__name__} has per-layer-type RoPE parameters ({sorted(params)}); "
                "mapping such models is not supported: use a model with one global RoPE"
            )
        out = dict(params)
    else:
        theta = getattr(config, "rope_theta", None)
        scaling = getattr(config, "rope_scaling", None)
        if theta is None and not scaling:
            return None
        out = {"rope_theta": theta if theta is not None else 10000.0}
        if isinstance(scaling, dict):
            out.update(scaling)
    out["rope_type"] = out.pop("type", None) or out.get("rope_type") or "default"
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None and "partial_rotary_factor" not in out:
        out["partial_rotary_factor"] = partial
    return out


def config_from_dict(config_dict: Mapping[str, object]) -> ModelConfig:
    """Rebuild a transformers config from ``config.to_dict()`` output (used when loading a mapping)."""
    from transformers import AutoConfig

    data = dict(config_dict)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise UnsupportedModelError("stored config has no model_type; recalibrate the mapping")
    return AutoConfig.for_model(str(model_type), **data)


@dataclass(eq=False)
class RopeSpec:
    """One model's rotary embedding: type, parameters and the config transformers computes it from."""

    rope_type: str
    """``none`` for models without RoPE, else the transformers rope type (``default``, ``yarn``, ...)."""
    parameters: JSONDict
    """The flat RoPE parameter dict (theta, factor, ...), JSON-serialisable."""
    head_dim: int
    """Per-head size of the keys this spec rotates."""
    max_position_embeddings: int | None
    """The model's maximum positions (used by dynamic scaling)."""
    config: ModelConfig | None = field(default=None, repr=False)
    """The transformers config, needed to call the rope init functions."""
    _cache: dict[tuple[str, int | None], tuple[torch.Tensor, float]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, config: ModelConfig) -> RopeSpec:
        """Describe the RoPE of a (text) model config."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        params = rope_parameters_of(config)
        max_pos = getattr(config, "max_position_embeddings", None)
        if params is None:
            return cls("none", {}, head_dim_of(config), max_pos, config)
        parameters = {str(k): _jsonable(v) for k, v in params.items()}
        return cls(str(params["rope_type"]), parameters, head_dim_of(config), max_pos, copy.deepcopy(config))

    @property
    def is_rotary(self) -> bool:
        return self.rope_type != "none"

    def describe(self) -> JSONDict:
        """JSON form for manifests and cache keys."""
        return {"rope_type": self.rope_type, "head_dim": self.head_dim, **self.parameters}

    def same_as(self, other: RopeSpec) -> bool:
        """True when both rotate keys identically (same type, parameters and head size)."""
        return self.describe() == other.describe()

    # ----------------------------------------------------------------- frequencies
    def frequencies(self, seq_len: int | None = None, device: DeviceLike | None = None) -> tuple[torch.Tensor, float]:
        """``(inv_freq, attention_scaling)`` as transformers computes them for a sequence of ``seq_len``."""
        import torch

        device = torch.device(device) if device is not None else torch.device("cpu")
        static = self.rope_type in _STATIC_TYPES
        key = (str(device), None if static else int(seq_len or 0))
        if key in self._cache:
            return self._cache[key]
        from transformers import modeling_rope_utils as mru

        fn = mru.ROPE_INIT_FUNCTIONS.get(self.rope_type)
        if self.rope_type == "default" and fn is None:
            inv_freq, scaling = self._default_frequencies(device)
        elif fn is None:
            raise UnsupportedModelError(
                f"rope type {self.rope_type!r} is not in this transformers' ROPE_INIT_FUNCTIONS "
                f"({sorted(mru.ROPE_INIT_FUNCTIONS)}); upgrade transformers or use another model"
            )
        else:
            config = copy.deepcopy(self.config)
            inv_freq, scaling = fn(config, device, seq_len=seq_len)
        result = (inv_freq.to(device=device, dtype=torch.float32), float(scaling))
        self._cache[key] = result
        return result

    def _default_frequencies(self, device: torch.device) -> tuple[torch.Tensor, float]:
        import torch

        base = _number(self.parameters.get("rope_theta", 10000.0))
        dim = int(self.head_dim * _number(self.parameters.get("partial_rotary_factor", 1.0)))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
        return inv_freq, 1.0

    def cos_sin(
        self, positions: torch.Tensor, seq_len: int | None = None, device: DeviceLike | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """transformers-style unscaled ``cos``/``sin`` (fp32, ``positions.shape + (rotary_dim,)``) and the scaling."""
        import torch

        tables = self.tables(positions, seq_len, device)
        half = tables.cos.shape[-1] // 2
        return tables.cos, torch.cat((tables.sin[..., half:], tables.sin[..., half:]), -1), tables.scaling

    def tables(self, positions: torch.Tensor, seq_len: int | None = None, device: DeviceLike | None = None) -> RopeTables:
        """cos/sin tables for ``positions`` (compute once, reuse to rotate many layers)."""
        import torch

        device = positions.device if device is None else device
        if seq_len is None:
            seq_len = int(positions.max().item()) + 1 if positions.numel() else 1
        inv_freq, scaling = self.frequencies(seq_len, device)
        freqs = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return RopeTables(torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1), scaling, positions.dim())

    @property
    def full_rotary(self) -> bool:
        """Every dimension of a head is rotated (no partial rotary factor)."""
        return self.is_rotary and _number(self.parameters.get("partial_rotary_factor", 1.0) or 1.0) == 1.0

    def phases(
        self, positions: torch.Tensor, seq_len: int | None = None, device: DeviceLike | None = None, *, inverse: bool = False
    ) -> torch.Tensor:
        """Complex rotations ``s·e^{±i·p·θ}`` (complex64, ``positions.shape + (rotary_dim / 2,)``).

        Multiplying a head viewed as complex pairs ``(x_i, x_{i + r/2})`` by this applies the
        rotation (``inverse``: undoes it, dividing by the attention scaling).
        """
        import torch

        device = positions.device if device is None else device
        if seq_len is None:
            seq_len = int(positions.max().item()) + 1 if positions.numel() else 1
        inv_freq, scaling = self.frequencies(seq_len, device)
        angles = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq
        if inverse:
            angles, scaling = -angles, 1.0 / scaling
        return torch.polar(torch.full_like(angles, float(scaling)), angles)

    # ----------------------------------------------------------------- rotation
    def _rotate(
        self, x: torch.Tensor, positions: torch.Tensor | None, inverse: bool, seq_len: int | None,
        tables: RopeTables | None, heads_last: bool = False,
    ) -> torch.Tensor:
        """Rotate pairs ``(i, i + r/2)`` of the first ``r`` dims by ±angle (and scale), in fp32.

        ``x·cos + swap(x)·sin`` with ``swap(x) = [x₂, x₁]`` and ``sin = [−sin, sin]`` — the same
        rotation as transformers' ``x·cos + rotate_half(x)·sin``; the inverse negates the angle and
        divides by the attention scaling. Layouts: ``x`` [B, H, T, D] with positions [T] or [B, T];
        ``x`` [N, H, D] with positions [N]; with ``heads_last``, ``x`` [B, T, H, D].
        """
        import torch

        if not self.is_rotary:
            return x
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"keys have head size {x.shape[-1]}, this RoPE expects {self.head_dim}")
        if tables is None:
            if positions is None:
                raise ValueError("pass positions or precomputed tables")
            tables = self.tables(positions, seq_len, x.device)
        cos, sin = tables.cos, tables.sin
        if heads_last:
            if x.dim() != 4:
                raise ValueError(f"heads_last expects [B, T, H, D], got {tuple(x.shape)}")
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [T, 1, r] or [B, T, 1, r]
        elif x.dim() == 4 and tables.position_dims == 1:
            pass  # [T, r] broadcasts against [B, H, T, r]
        elif (x.dim() == 4 and tables.position_dims == 2) or (x.dim() == 3 and tables.position_dims == 1):
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, r] or [N, 1, r]
        else:
            raise ValueError(f"cannot rotate a tensor of shape {tuple(x.shape)} with {tables.position_dims}-d positions")
        scale = 1.0 / tables.scaling if inverse else tables.scaling
        if inverse:
            sin = -sin
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        rot = cos.shape[-1]
        half = rot // 2
        work = x if x.dtype == torch.float32 else x.float()
        if rot == work.shape[-1]:
            swapped = torch.cat((work[..., half:], work[..., :half]), -1)
            return work * cos + swapped * sin
        head = work[..., :rot]
        swapped = torch.cat((head[..., half:], head[..., :half]), -1)
        return torch.cat((head * cos + swapped * sin, work[..., rot:]), -1)

    def apply(
        self, keys: torch.Tensor, positions: torch.Tensor | None = None, seq_len: int | None = None, *,
        tables: RopeTables | None = None, heads_last: bool = False,
    ) -> torch.Tensor:
        """Rotate content-space keys into this model's cache space (what the model stores)."""
        return self._rotate(keys, positions, False, seq_len, tables, heads_last)

    def strip(
        self, keys: torch.Tensor, positions: torch.Tensor | None = None, seq_len: int | None = None, *,
        tables: RopeTables | None = None, heads_last: bool = False,
    ) -> torch.Tensor:
        """Undo this model's rotation (and attention scaling) on cached keys: content space."""
        return self._rotate(keys, positions, True, seq_len, tables, heads_last)


@dataclass(frozen=True)
class RopeTables:
    """Precomputed RoPE tables for one set of positions."""

    cos: torch.Tensor
    """``positions.shape + (rotary_dim,)`` cosines ``[cos, cos]`` (fp32, unscaled)."""
    sin: torch.Tensor
    """Same shape, signed sines ``[−sin, sin]``."""
    scaling: float
    """The rope type's attention scaling (1 except yarn/longrope)."""
    position_dims: int
    """1 for positions ``[T]`` (or ``[N]``), 2 for ``[B, T]``."""


def _jsonable(value: object) -> JSONValue:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _number(value: JSONValue) -> float:
    """A numeric RoPE parameter as a float (``float()`` of anything else raises, as it always did)."""
    if isinstance(value, (dict, list)) or value is None:
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)
