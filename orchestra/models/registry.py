"""Family members by alias: resolved and checked before anything loads, loaded lazily and once, placed on devices.

An alias names a family member (name or role), a local model folder or a Hugging Face Hub id
(``org/name[@revision]``, `orchestra.models.modelref`). Resolution reads only configs and tokenizers (cheap),
so a pipeline that names a missing model or a model from another family is refused before any
weights are read; a folder's weights are hashed once and the digest kept beside it (`orchestra.models.fpcache`),
a Hub snapshot's taken from the hashes the Hub cache holds.

An alias may also name a LoRA adapter (`orchestra.models.modelref.AdapterSpec`, or a plain adapter folder whose
``base_model_name_or_path`` is another declared model's reference): it is loaded over its base's weights,
held once (`orchestra.models.lora`), shares its base's lock, and has a fingerprint of its own
(:class:`AdapterLineage` says what it shares with its base; :func:`shared_layers`, which K/V are exact).

An alias may also name a quantized view of another declared model (`orchestra.models.modelref.QuantizeSpec`): the
base's weights loaded again and quantized by torchao (`orchestra.models.quantize`), a member with its own tensors,
lock and fingerprint (:class:`QuantizedLineage`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from orchestra.errors import (
    AdapterBaseError,
    CrossFamilyError,
    DevicePlacementError,
    ModelReferenceError,
    QuantizeBaseError,
    UnknownModelError,
)

if TYPE_CHECKING:
    from mappings.models import ModelHandle
    from mappings.types import Model, Tokenizer
    from orchestra.models.lora import LoraLayout
    from orchestra.models.modelref import AdapterSpec, QuantizeSpec, ResolvedAdapter, ResolvedModel

__all__ = ["ModelInfo", "LoadedModel", "ModelRegistry", "rope_key", "pick_device", "resolve_dtype", "parameter_count",
           "read_model_config",
           "AdapterLineage", "shared_layers", "QuantizedLineage"]


def rope_key(config_dict: Mapping[str, object]) -> str:
    """Canonical JSON of everything RoPE-related in a config (5.x `rope_parameters` or 4.x fields)."""
    keys = ("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "max_position_embeddings")
    return json.dumps({k: config_dict.get(k) for k in keys if config_dict.get(k) is not None}, sort_keys=True)


@dataclass(frozen=True)
class AdapterLineage:
    """What a LoRA adapter member shares with its base member."""

    base_alias: str
    """The alias of the model the adapter is applied to (its weights are that member's, held once)."""
    base_fingerprint: str
    """The base's combined fingerprint: members over the same base share the K/V of their untouched layers."""
    untouched_layers: int
    """Leading decoder layers whose K/V are exactly the base's (below the first layer the adapter changes)."""
    adapter_bytes: int
    """Memory the adapter adds to its base's: its LoRA factors, held in float32."""
    tokenizer_path: Path
    """The folder the member's tokenizer is loaded from: the adapter's own when it ships one, else the base's."""


@dataclass(frozen=True)
class QuantizedLineage:
    """What a quantized view shares with its base member: the config and tokenizer, not the tensors."""

    base_alias: str
    """The alias of the model whose weights the view quantizes (loaded again from its files)."""
    base_fingerprint: str
    """The base's combined fingerprint."""
    scheme: str
    """The quantize scheme (`orchestra.models.quantize.SCHEMES`)."""
    torchao_version: str
    """The torchao that quantizes it (in the fingerprint: another version may round differently)."""
    dtype: str
    """The dtype the view computes in: the pipeline's, or the one its scheme needs (int4: bfloat16)."""
    estimated_bytes: int
    """The memory the view is expected to hold, from its base's tensor shapes (loading measures the real one)."""


@dataclass(frozen=True)
class ModelInfo:
    """What is known about a model without loading its weights."""

    alias: str
    name: str
    path: Path
    fingerprint: str
    # `mappings.fingerprint.token_ids_digest`: equal exactly when two members give the same token ids
    tokenizer_digest: str
    num_layers: int
    max_positions: int
    weight_bytes: int
    rope: str
    # the model's config.json as read (readers index into it: config["text_config"]["vocab_size"])
    config: dict[str, Any] = field(hash=False, compare=False, repr=False)
    # the parts of `fingerprint` (config, weights, tokenizer, combined), so a mapping calibrated from this
    # model records the fingerprint it is looked up by without hashing the weights again
    fingerprint_parts: dict[str, str] = field(default_factory=dict, hash=False, compare=False, repr=False)
    # a LoRA adapter member: its base and what it shares with it (None: a model of its own)
    adapter: AdapterLineage | None = None
    # a quantized view: its base, scheme and torchao (None: not a view)
    quantized: QuantizedLineage | None = None
    # parameters in the model's own files, from their headers (an adapter's or view's: its base's)
    num_parameters: int = field(default=0, compare=False)

    @property
    def tokenizer_path(self) -> Path:
        """The folder the tokenizer loads from (an adapter without one of its own uses its base's)."""
        return self.adapter.tokenizer_path if self.adapter is not None else self.path


def shared_layers(source: ModelInfo, target: ModelInfo) -> int:
    """How many leading layers give exactly the same K/V on both models: 0 unless both are one base or
    adapters over it (then every layer below the first either adapter changes; all for the same weights).

    The mapping store passes these layers through unchanged instead of fitting them.
    """
    def lineage(info: ModelInfo) -> tuple[str, int]:
        if info.adapter is not None:
            return info.adapter.base_fingerprint, info.adapter.untouched_layers
        return info.fingerprint, info.num_layers

    (s_base, s_layers), (t_base, t_layers) = lineage(source), lineage(target)
    return min(s_layers, t_layers, source.num_layers, target.num_layers) if s_base == t_base else 0


class FamilyMember(Protocol):
    """What the registry reads of a family member's record (``orchestra.family.MemberRecord``)."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def fingerprint(self) -> dict[str, str]: ...


class FamilyIndex(Protocol):
    """What the registry reads of a family (``orchestra.family.FamilyManifest``): its members by name."""

    @property
    def members(self) -> Mapping[str, FamilyMember]: ...

    def member(self, key: str) -> FamilyMember: ...


@dataclass
class LoadedModel:
    info: ModelInfo
    model: Model
    tokenizer: Tokenizer
    device: str
    dtype: str
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Serialises forward passes on this model (modules are not re-entrant across threads). A base and its
    LoRA adapters hold the same lock object: they run on the same weight tensors. Callers taking several
    members' locks take each distinct lock once (`LocalExecutor.exclusive`), so sharing one cannot deadlock."""

    def handle(self) -> ModelHandle:
        """This model as a `mappings` handle carrying the registry's fingerprint.

        A mapping calibrated from it records the fingerprint the registry looks it up by (for a Hub model
        that differs from hashing the tensors in memory), and no weight is hashed again.
        """
        from mappings.fingerprint import Fingerprint, fingerprint_model
        from mappings.models import ModelHandle

        parts = self.info.fingerprint_parts
        fp = None
        if all(k in parts for k in ("config", "weights", "tokenizer")):
            fp = Fingerprint(parts["config"], parts["weights"], parts["tokenizer"])
        if fp is None or fp.combined != self.info.fingerprint:  # parts not known: hash the model in memory
            fp = fingerprint_model(self.model, self.tokenizer)
        return ModelHandle(self.model, self.tokenizer, fp, self.info.path)


def _free_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def resolve_dtype(dtype: str, requested_device: str) -> str:
    """The dtype a member computes in: ``auto`` is bfloat16 on CUDA that supports it (float16 on older CUDA)
    and float32 on CPU; any other dtype as given.

    Decided by the *requested* device (``auto`` counts as CUDA when CUDA is available), not by where the model
    lands, so a member's cache keys (which hold its dtype) are known before it loads and never change with it.
    """
    if dtype != "auto":
        return dtype
    import torch

    if not torch.cuda.is_available() or not (requested_device == "auto" or requested_device.startswith("cuda")):
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def read_model_config(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model folder's config.json and its text part (``text_config`` of a multimodal config, else the whole)."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return config, config.get("text_config", config)


def parameter_count(path: Path) -> int:
    """Parameters in a folder's ``*.safetensors`` files, from their headers (no tensor is read)."""
    from safetensors import safe_open

    count = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                size = 1
                for dim in sf.get_slice(key).get_shape():
                    size *= int(dim)
                count += size
    return count


def pick_device(requested: str, need_bytes: int, reserved: dict[str, int]) -> str:
    """Resolve ``auto`` (the CUDA device with most free memory that fits, else CPU) and check the fit."""
    import torch

    if requested == "auto":
        candidates = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        fitting = [(d, _free_bytes(d) - reserved.get(d, 0)) for d in candidates]
        fitting = [(d, free) for d, free in fitting if free >= need_bytes]
        if fitting:
            return max(fitting, key=lambda item: item[1])[0]
        requested = "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DevicePlacementError(f"device {requested!r} requested but CUDA is not available; use 'cpu' or 'auto'")
        index = torch.device(requested).index or 0
        if index >= torch.cuda.device_count():
            raise DevicePlacementError(
                f"device {requested!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif requested != "cpu":
        raise DevicePlacementError(f"unknown device {requested!r}; use 'cpu', 'cuda:N' or 'auto'")
    free = _free_bytes(requested) - reserved.get(requested, 0)
    if need_bytes > free:
        raise DevicePlacementError(
            f"a model of {need_bytes / 2**20:.0f} MiB does not fit on {requested} ({max(free, 0) / 2**20:.0f} MiB free "
            f"after the models already placed there); choose another device or fewer models"
        )
    return requested


@dataclass(frozen=True)
class _Adapter:
    """An alias resolved to a LoRA adapter: the alias of its base and the adapter's folder and layout."""

    base: str
    resolved: ResolvedAdapter
    layout: LoraLayout


class ModelRegistry:
    """Aliases → family members, local folders, Hub ids, LoRA adapters or quantized views; loads each model once."""

    def __init__(
        self,
        aliases: Mapping[str, str | AdapterSpec | QuantizeSpec],
        *,
        family: FamilyIndex | None = None,
        devices: dict[str, str] | None = None,
        default_device: str = "auto",
        dtype: str = "auto",
    ) -> None:
        self.aliases: dict[str, str | AdapterSpec | QuantizeSpec] = dict(aliases)
        self.family = family
        self.devices = dict(devices or {})
        self.default_device = default_device
        self.dtype = dtype
        self._infos: dict[str, ModelInfo] = {}
        self._adapters: dict[str, _Adapter | None] = {}
        self._loaded: dict[str, LoadedModel] = {}
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- resolution (no weights) ------------------------------------------------------------
    def _target(self, alias: str) -> str | AdapterSpec | QuantizeSpec:
        if alias not in self.aliases:
            raise UnknownModelError(
                f"model {alias!r} is not declared in the pipeline's models; declared: {', '.join(sorted(self.aliases))}"
            )
        return self.aliases[alias]

    def _record(self, target: str) -> FamilyMember | None:
        """The family member `target` names (a name or role), else None."""
        if self.family is None:
            return None
        try:
            return self.family.member(target)
        except Exception:  # not a member name: maybe a folder path or a Hub id
            return None

    def _path_for(self, alias: str) -> tuple[str, Path, dict[str, str] | None, ResolvedModel | None]:
        """(name, folder, the family record's fingerprint, None) for a member; (.., None, resolved) otherwise."""
        from orchestra.models.modelref import ModelRef

        target = self._target(alias)
        assert isinstance(target, str)  # adapters are resolved by `_adapter`, quantized views by `_quantized_info`
        record = self._record(target)
        if record is not None:
            return record.name, Path(record.path), record.fingerprint, None
        ref = ModelRef.parse(target)
        if not ref.is_hub and not (ref.folder / "config.json").is_file():
            members = ", ".join(self.family.members) if self.family is not None else "(no family loaded)"
            raise UnknownModelError(
                f"model {alias!r} -> {target!r} is neither a family member ({members}) nor a model folder "
                f"with a config.json nor a Hugging Face Hub id (org/name[@revision]); fix the path or build "
                f"the family with `orchestra family build`"
            )
        try:
            resolved = ref.resolve()
        except ModelReferenceError as exc:  # typed errors of the reference: the same type, naming the alias
            raise type(exc)(f"model {alias!r} -> {exc}") from exc
        return resolved.name, resolved.path, None, resolved

    def _adapter(self, alias: str) -> _Adapter | None:
        """The LoRA adapter `alias` names (resolved, its base checked and its layout read), or None for a model."""
        if alias in self._adapters:
            return self._adapters[alias]
        from orchestra.models.modelref import AdapterSpec, ModelRef, QuantizeSpec, is_adapter_folder

        target = self._target(alias)
        if isinstance(target, QuantizeSpec):
            self._adapters[alias] = None
            return None
        if isinstance(target, AdapterSpec):
            base: str | None = self._checked_base(alias, target.base)
            ref = ModelRef.parse(target.adapter)
        else:
            ref = ModelRef.parse(target)
            if self._record(target) is not None or ref.is_hub or not is_adapter_folder(ref.folder):
                self._adapters[alias] = None
                return None
            base = None
        from orchestra.models.lora import LoraLayout

        try:
            resolved = ref.resolve_adapter()
            found = _Adapter(base or self._base_named_by(alias, resolved), resolved,
                             LoraLayout.read(resolved.path, resolved.config))
        except AdapterBaseError:
            raise
        except ModelReferenceError as exc:  # the same type, naming the alias
            raise type(exc)(f"model {alias!r} -> {exc}") from exc
        self._adapters[alias] = found
        return found

    def _plain(self, alias: str) -> list[str]:
        """The declared aliases other than `alias` that name a model of their own (not an adapter or a view)."""
        return [a for a in self.aliases if a != alias and not self._is_adapter_target(a) and not self._is_view(a)]

    def _is_view(self, alias: str) -> bool:
        from orchestra.models.modelref import QuantizeSpec

        return isinstance(self.aliases.get(alias), QuantizeSpec)

    def _checked_base(self, alias: str, base: str) -> str:
        """`base`, once it is known to be a declared model that is not itself an adapter; else AdapterBaseError."""
        plain = self._plain(alias)
        if base not in self.aliases or base == alias:
            raise AdapterBaseError(
                f"model {alias!r} is a LoRA adapter over {base!r}, which is not a declared model: set its base "
                f"to one of {', '.join(plain) or '(none declared)'}, or declare {base!r} in models"
            )
        if self._is_adapter_target(base):
            raise AdapterBaseError(
                f"model {alias!r} is a LoRA adapter over {base!r}, which is an adapter itself: set its base to the "
                f"model both were trained on ({', '.join(plain) or 'declare it in models'})"
            )
        if self._is_view(base):
            raise AdapterBaseError(
                f"model {alias!r} is a LoRA adapter over {base!r}, which is a quantized view: set its base to the "
                f"model the view quantizes ({', '.join(plain) or 'declare it in models'})"
            )
        return base

    def _is_adapter_target(self, alias: str) -> bool:
        from orchestra.models.modelref import AdapterSpec, ModelRef, QuantizeSpec, is_adapter_folder

        target = self.aliases[alias]
        if isinstance(target, AdapterSpec):
            return True
        if isinstance(target, QuantizeSpec):
            return False
        ref = ModelRef.parse(target)
        return self._record(target) is None and not ref.is_hub and is_adapter_folder(ref.folder)

    def _base_named_by(self, alias: str, adapter: ResolvedAdapter) -> str:
        """The declared model whose reference is the adapter's ``base_model_name_or_path``; else AdapterBaseError."""
        named = adapter.base_reference
        for candidate, target in self.aliases.items():
            if candidate != alias and isinstance(target, str) and named is not None and self._same_reference(
                    target, named) and not self._is_adapter_target(candidate):
                return candidate
        what = f"over {named!r}" if named is not None else "that names no base (no base_model_name_or_path)"
        raise AdapterBaseError(
            f"model {alias!r} -> {adapter.path} is a LoRA adapter {what}, which is not a declared model: declare "
            f"its base in models and write this one as {{adapter: {adapter.ref.text}, base: <the base's alias>}}"
        )

    def _same_reference(self, target: str, reference: str) -> bool:
        """Whether a declared target and a reference written elsewhere name the same model (id or folder)."""
        from orchestra.models.modelref import ModelRef

        if target.strip() == reference.strip():
            return True
        mine, theirs = ModelRef.parse(target), ModelRef.parse(reference)
        if mine.is_hub or theirs.is_hub:
            return mine.repo_id is not None and mine.repo_id == theirs.repo_id and theirs.revision in (None,
                                                                                                     mine.revision)
        record = self._record(target)
        folder = Path(record.path) if record is not None else mine.folder
        return folder.resolve() == theirs.folder.resolve()

    def info(self, alias: str) -> ModelInfo:
        if alias in self._infos:
            return self._infos[alias]
        from orchestra.models.modelref import QuantizeSpec

        target = self._target(alias)
        if isinstance(target, QuantizeSpec):
            info = self._quantized_info(alias, target)
        else:
            adapter = self._adapter(alias)
            info = self._adapter_info(alias, adapter) if adapter is not None else self._model_info(alias)
        self._infos[alias] = info
        return info

    def _model_info(self, alias: str) -> ModelInfo:
        from transformers import AutoTokenizer

        from mappings.fingerprint import token_ids_digest

        name, path, fp, resolved = self._path_for(alias)
        config, text = read_model_config(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:
            raise UnknownModelError(f"model {alias!r} at {path} has no loadable tokenizer: {exc}") from exc
        if resolved is not None:  # a folder or a Hub snapshot: weights digest cached or from the Hub cache
            fingerprint = resolved.fingerprint(tokenizer)
            parts = fingerprint.as_dict()
        else:
            assert fp is not None  # a family member: its record's fingerprint
            parts = dict(fp)
        # Sharing a cache needs the same token ids, not the fingerprint's tokenizer part (the model's
        # identity, eos/pad roles included): a base checkpoint and its instruct sibling agree here.
        tok_digest = token_ids_digest(tokenizer)
        weight_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        return ModelInfo(
            alias=alias, name=name, path=path, fingerprint=parts["combined"], tokenizer_digest=tok_digest,
            num_layers=int(text.get("num_hidden_layers", 0)), max_positions=int(text.get("max_position_embeddings", 0)),
            weight_bytes=weight_bytes, rope=rope_key(text), config=config, fingerprint_parts=parts,
            num_parameters=parameter_count(path),
        )

    def _adapter_info(self, alias: str, adapter: _Adapter) -> ModelInfo:
        """An adapter member: its base's config, RoPE and (unless it ships one) tokenizer; a fingerprint of its own.

        Fingerprint parts: the base's config part; the base's tokenizer part, or the adapter's own tokenizer's;
        weights: sha256 over the base's weights part and the adapter's digest (config and tensors).
        """
        import hashlib

        from transformers import AutoTokenizer

        from mappings.fingerprint import Fingerprint, token_ids_digest, tokenizer_digest

        base = self.info(adapter.base)
        own_tokenizer = adapter.resolved.tokenizer_folder
        tokenizer_path = own_tokenizer or base.tokenizer_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        except Exception as exc:
            raise UnknownModelError(f"model {alias!r}: no loadable tokenizer at {tokenizer_path}: {exc}") from exc
        parts = base.fingerprint_parts
        weights = hashlib.sha256(f"{parts.get('weights', base.fingerprint)}:{adapter.resolved.digest()}".encode())
        fp = Fingerprint(config=parts.get("config", base.fingerprint), weights=weights.hexdigest(),
                         tokenizer=tokenizer_digest(tokenizer) if own_tokenizer else parts.get("tokenizer", ""))
        file_bytes = (adapter.resolved.path / "adapter_model.safetensors").stat().st_size
        lineage = AdapterLineage(base_alias=adapter.base, base_fingerprint=base.fingerprint,
                                 untouched_layers=adapter.layout.untouched_layers(base.num_layers),
                                 adapter_bytes=adapter.layout.factor_bytes, tokenizer_path=tokenizer_path)
        return ModelInfo(
            alias=alias, name=adapter.resolved.name, path=adapter.resolved.path, fingerprint=fp.combined,
            tokenizer_digest=token_ids_digest(tokenizer), num_layers=base.num_layers, max_positions=base.max_positions,
            # what a forward pass reads (prefill estimates scale by it); the memory it adds is adapter_bytes
            weight_bytes=base.weight_bytes + file_bytes, rope=base.rope, config=base.config,
            fingerprint_parts=fp.as_dict(), adapter=lineage, num_parameters=base.num_parameters,
        )

    def _quantized_info(self, alias: str, spec: QuantizeSpec) -> ModelInfo:
        """A quantized view: its base's config, tokenizer, RoPE and folder; a fingerprint of its own.

        Fingerprint parts: the base's config and tokenizer parts; weights: sha256 over the base's weights part,
        the spec's canonical JSON (scheme, torchao config, which modules) and the torchao version. Checked here,
        before any weights load: the base (declared, plain), torchao (installed) and the device (able to run it).
        """
        import hashlib

        import torch

        from mappings.fingerprint import Fingerprint
        from orchestra.models.quantize import SCHEMES, check_device, estimate_bytes, torchao_version

        plain = self._plain(alias)
        if spec.base not in plain:
            declared = spec.base in self.aliases and spec.base != alias
            why = "which is not a model of its own (an adapter or another view)" if declared else (
                "which is not a declared model")
            raise QuantizeBaseError(
                f"model {alias!r} is a quantized view of {spec.base!r}, {why}: set its base to one of "
                f"{', '.join(plain) or '(none declared)'}" + ("" if declared else f", or declare {spec.base!r} in models")
            )
        version = torchao_version(alias)
        scheme = SCHEMES[spec.quantize]
        check_device(alias, scheme, self.devices.get(alias, self.default_device))
        base = self.info(spec.base)
        parts = base.fingerprint_parts
        payload = f"quantized-view-v1\n{parts.get('weights', base.fingerprint)}\n{spec.canonical()}\ntorchao {version}"
        fp = Fingerprint(config=parts.get("config", base.fingerprint),
                         weights=hashlib.sha256(payload.encode()).hexdigest(), tokenizer=parts.get("tokenizer", ""))
        dtype = scheme.compute_dtype or self.dtype_of(alias)
        size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
        lineage = QuantizedLineage(base_alias=spec.base, base_fingerprint=base.fingerprint, scheme=scheme.name,
                                   torchao_version=version, dtype=dtype,
                                   estimated_bytes=estimate_bytes(base.path, scheme, size, base.num_layers))
        return ModelInfo(
            alias=alias, name=f"{base.name}-{scheme.name}", path=base.path, fingerprint=fp.combined,
            tokenizer_digest=base.tokenizer_digest, num_layers=base.num_layers, max_positions=base.max_positions,
            # prefill estimates scale by it: a view does its base's arithmetic (weight-only schemes dequantize as
            # they go), so it is the base's; the memory it holds is `quantized.estimated_bytes`
            weight_bytes=base.weight_bytes, rope=base.rope, config=base.config, fingerprint_parts=fp.as_dict(),
            quantized=lineage, num_parameters=base.num_parameters,
        )

    def check_family(self, source_alias: str) -> None:
        """Every declared model must give the source's token ids, or its KV cannot be shared.

        Compared by what decides ids (``ModelInfo.tokenizer_digest``): other special-token roles or
        chat templates are fine; the refusal names what differs (vocabulary size, ids, merges, ...).
        """
        source = self.info(source_alias)
        for alias in self.aliases:
            info = self.info(alias)
            if info.tokenizer_digest != source.tokenizer_digest:
                from transformers import AutoTokenizer

                from mappings.tokenizer_compat import compare_tokenizers

                # loaded again only on this error path: the infos keep digests, not tokenizers
                diff = compare_tokenizers(AutoTokenizer.from_pretrained(str(info.tokenizer_path)),
                                          AutoTokenizer.from_pretrained(str(source.tokenizer_path)),
                                          names=(f"member {alias}", f"the source {source_alias}"))
                raise CrossFamilyError(
                    diff.refusal(f"member {alias}", source_alias)
                    + f": remove {alias!r} ({info.path}) or give it a pipeline of its own"
                )

    # -- loading ----------------------------------------------------------------------------
    def load(self, alias: str) -> LoadedModel:
        with self._lock:
            return self._load(alias)

    def dtype_of(self, alias: str) -> str:
        """The dtype `alias` computes in (`resolve_dtype` of the registry's dtype on its requested device)."""
        return resolve_dtype(self.dtype, self.devices.get(alias, self.default_device))

    def load_estimate(self, alias: str) -> int:
        """Bytes a plain member takes once loaded: its parameters (from the files' headers) at the dtype it
        computes in, plus 10% — not its file size, which a bf16 checkpoint loaded in float32 doubles."""
        import torch

        element = torch.tensor([], dtype=getattr(torch, self.dtype_of(alias))).element_size()
        return int(self.info(alias).num_parameters * element * 1.1)

    def _load(self, alias: str) -> LoadedModel:
        """`load` with the registry's lock held (an adapter loads its base first, under the same hold)."""
        if alias in self._loaded:
            return self._loaded[alias]
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        info = self.info(alias)
        if info.adapter is not None:
            loaded = self._load_adapter(alias, info, info.adapter)
        elif info.quantized is not None:
            loaded = self._load_quantized(alias, info, info.quantized)
        else:
            dtype = self.dtype_of(alias)
            need = self.load_estimate(alias)
            device = pick_device(self.devices.get(alias, self.default_device), need, self._reserved)
            model = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=getattr(torch, dtype),
                                                         use_safetensors=True)
            model.to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the bound self
            tokenizer = AutoTokenizer.from_pretrained(str(info.path))
            self._reserved[device] = self._reserved.get(device, 0) + need
            loaded = LoadedModel(info=info, model=model, tokenizer=tokenizer, device=device, dtype=dtype)
        self._loaded[alias] = loaded
        return loaded

    def _load_adapter(self, alias: str, info: ModelInfo, lineage: AdapterLineage) -> LoadedModel:
        """The adapter over its base member's weights (loaded first): its own module tree, the base's tensors and lock."""
        from transformers import AutoTokenizer

        from orchestra.models.lora import attach_lora

        base = self._load(lineage.base_alias)
        requested = self.devices.get(alias, "auto")
        if requested not in ("auto", base.device):
            raise DevicePlacementError(
                f"model {alias!r} is a LoRA adapter over {lineage.base_alias!r}, whose weights it shares on "
                f"{base.device}: remove devices.{alias} (it goes where its base is), or place the base on {requested}"
            )
        need = int(lineage.adapter_bytes * 1.1)
        pick_device(base.device, need, self._reserved)  # the factors must fit beside the base
        adapter = self._adapter(alias)
        assert adapter is not None  # info() found it
        # taken while the tree is copied, so no hook an op put on the base for its pass is copied with it
        with base.lock:
            model = attach_lora(base.model, adapter.layout)
        tokenizer = AutoTokenizer.from_pretrained(str(lineage.tokenizer_path))
        self._reserved[base.device] = self._reserved.get(base.device, 0) + need
        return LoadedModel(info=info, model=model, tokenizer=tokenizer, device=base.device, dtype=base.dtype,
                           lock=base.lock)

    def _load_quantized(self, alias: str, info: ModelInfo, lineage: QuantizedLineage) -> LoadedModel:
        """The view: its base's weights read again from their files (the base need not be loaded), then quantized."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from orchestra.models.quantize import SCHEMES, check_device, quantize_decoder, resident_bytes

        scheme = SCHEMES[lineage.scheme]
        device = pick_device(self.devices.get(alias, self.default_device), int(lineage.estimated_bytes * 1.1),
                             self._reserved)
        check_device(alias, scheme, device)  # `auto` may have settled on a device the scheme cannot use
        # Read on the CPU: torchao moves each Linear to the device as it quantizes it, so the device never holds
        # the full-precision copy.
        model = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=getattr(torch, lineage.dtype),
                                                     use_safetensors=True)
        model.eval()
        quantize_decoder(model, alias, scheme, device)
        tokenizer = AutoTokenizer.from_pretrained(str(info.tokenizer_path))
        self._reserved[device] = self._reserved.get(device, 0) + resident_bytes(model)
        return LoadedModel(info=info, model=model, tokenizer=tokenizer, device=device, dtype=lineage.dtype)

    def loaded(self) -> dict[str, LoadedModel]:
        return dict(self._loaded)
