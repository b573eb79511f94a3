"""Family members by alias: resolved and checked before anything loads, loaded lazily and once, placed on devices.

An alias names a family member (name or role), a local model folder or a Hugging Face Hub id
(``org/name[@revision]``, `orchestra.modelref`). Resolution reads only configs and tokenizers (cheap),
so a pipeline that names a missing model or a model from another family is refused before any
weights are read; a folder's weights are hashed once and the digest kept beside it (`orchestra.fpcache`),
a Hub snapshot's taken from the hashes the Hub cache holds.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from orchestra.errors import CrossFamilyError, DevicePlacementError, ModelReferenceError, UnknownModelError

if TYPE_CHECKING:
    from mappings.models import ModelHandle
    from mappings.types import Model, Tokenizer
    from orchestra.modelref import ResolvedModel

__all__ = ["ModelInfo", "LoadedModel", "ModelRegistry", "rope_key", "pick_device"]


def rope_key(config_dict: Mapping[str, object]) -> str:
    """Canonical JSON of everything RoPE-related in a config (5.x `rope_parameters` or 4.x fields)."""
    keys = ("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "max_position_embeddings")
    return json.dumps({k: config_dict.get(k) for k in keys if config_dict.get(k) is not None}, sort_keys=True)


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
    """Serialises forward passes on this model (modules are not re-entrant across threads)."""

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


class ModelRegistry:
    """Aliases → family members or local folders; loads each model once, on its device."""

    def __init__(
        self,
        aliases: dict[str, str],
        *,
        family: FamilyIndex | None = None,
        devices: dict[str, str] | None = None,
        default_device: str = "auto",
        dtype: str = "float32",
    ) -> None:
        self.aliases = dict(aliases)
        self.family = family
        self.devices = dict(devices or {})
        self.default_device = default_device
        self.dtype = dtype
        self._infos: dict[str, ModelInfo] = {}
        self._loaded: dict[str, LoadedModel] = {}
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- resolution (no weights) ------------------------------------------------------------
    def _path_for(self, alias: str) -> tuple[str, Path, dict[str, str] | None, ResolvedModel | None]:
        """(name, folder, the family record's fingerprint, None) for a member; (.., None, resolved) otherwise."""
        from orchestra.modelref import ModelRef

        if alias not in self.aliases:
            raise UnknownModelError(
                f"model {alias!r} is not declared in the pipeline's models; declared: {', '.join(sorted(self.aliases))}"
            )
        target = self.aliases[alias]
        if self.family is not None:
            try:
                record = self.family.member(target)
                return record.name, Path(record.path), record.fingerprint, None
            except Exception:  # not a member name: maybe a folder path or a Hub id
                pass
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

    def info(self, alias: str) -> ModelInfo:
        if alias in self._infos:
            return self._infos[alias]
        from transformers import AutoTokenizer

        from mappings.fingerprint import token_ids_digest

        name, path, fp, resolved = self._path_for(alias)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
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
        text = config.get("text_config", config)
        weight_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        info = ModelInfo(
            alias=alias, name=name, path=path, fingerprint=parts["combined"], tokenizer_digest=tok_digest,
            num_layers=int(text.get("num_hidden_layers", 0)), max_positions=int(text.get("max_position_embeddings", 0)),
            weight_bytes=weight_bytes, rope=rope_key(text), config=config, fingerprint_parts=parts,
        )
        self._infos[alias] = info
        return info

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
                diff = compare_tokenizers(AutoTokenizer.from_pretrained(str(info.path)),
                                          AutoTokenizer.from_pretrained(str(source.path)),
                                          names=(f"member {alias}", f"the source {source_alias}"))
                raise CrossFamilyError(
                    diff.refusal(f"member {alias}", source_alias)
                    + f": remove {alias!r} ({info.path}) or give it a pipeline of its own"
                )

    # -- loading ----------------------------------------------------------------------------
    def load(self, alias: str) -> LoadedModel:
        with self._lock:
            if alias in self._loaded:
                return self._loaded[alias]
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            info = self.info(alias)
            torch_dtype = getattr(torch, self.dtype)
            need = int(info.weight_bytes * torch.tensor([], dtype=torch_dtype).element_size() / 4 * 1.1)
            device = pick_device(self.devices.get(alias, self.default_device), need, self._reserved)
            model = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=torch_dtype, use_safetensors=True)
            model.to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the bound self
            tokenizer = AutoTokenizer.from_pretrained(str(info.path))
            self._reserved[device] = self._reserved.get(device, 0) + need
            loaded = LoadedModel(info=info, model=model, tokenizer=tokenizer, device=device, dtype=self.dtype)
            self._loaded[alias] = loaded
            return loaded

    def loaded(self) -> dict[str, LoadedModel]:
        return dict(self._loaded)
