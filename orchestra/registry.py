"""Family members by alias: resolved and checked before anything loads, loaded lazily and once, placed on devices.

Resolution reads only configs and tokenizers (cheap), so a pipeline that names a missing model or
a model from another family is refused before any weights are read.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from orchestra.errors import CrossFamilyError, DevicePlacementError, UnknownModelError

if TYPE_CHECKING:
    from mappings.types import Model, Tokenizer

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
    tokenizer_digest: str
    num_layers: int
    max_positions: int
    weight_bytes: int
    rope: str
    # the model's config.json as read (readers index into it: config["text_config"]["vocab_size"])
    config: dict[str, Any] = field(hash=False, compare=False, repr=False)


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


_FOLDER_FPS: dict[tuple[str, str], str] = {}


def _folder_fingerprint(path: Path) -> str:
    """Content fingerprint of a folder outside the family (hashes the weights once per file state)."""
    from mappings.fingerprint import fingerprint_dir

    stamp = ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(path.iterdir()) if p.is_file())
    key = (str(path), stamp)
    if key not in _FOLDER_FPS:
        _FOLDER_FPS[key] = fingerprint_dir(path).combined
    return _FOLDER_FPS[key]


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
    def _path_for(self, alias: str) -> tuple[str, Path, dict[str, str] | None]:
        if alias not in self.aliases:
            raise UnknownModelError(
                f"model {alias!r} is not declared in the pipeline's models; declared: {', '.join(sorted(self.aliases))}"
            )
        target = self.aliases[alias]
        if self.family is not None:
            try:
                record = self.family.member(target)
                return record.name, Path(record.path), record.fingerprint
            except Exception:  # not a member name: maybe a folder path
                pass
        path = Path(target).expanduser()
        if not (path / "config.json").is_file():
            members = ", ".join(self.family.members) if self.family is not None else "(no family loaded)"
            raise UnknownModelError(
                f"model {alias!r} -> {target!r} is neither a family member ({members}) nor a model folder "
                f"with a config.json; fix the path or build the family with `orchestra family build`"
            )
        return path.name, path.resolve(), None

    def info(self, alias: str) -> ModelInfo:
        if alias in self._infos:
            return self._infos[alias]
        from transformers import AutoTokenizer

        from mappings.fingerprint import tokenizer_digest

        name, path, fp = self._path_for(alias)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:
            raise UnknownModelError(f"model {alias!r} at {path} has no loadable tokenizer: {exc}") from exc
        tok_digest = tokenizer_digest(tokenizer)
        if fp is None:
            if not any(path.glob("*.safetensors")):
                raise UnknownModelError(f"model {alias!r} at {path} has no *.safetensors weights (only safetensors are loaded)")
            combined = _folder_fingerprint(path)
        else:
            combined = fp["combined"]
        text = config.get("text_config", config)
        weight_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        info = ModelInfo(
            alias=alias, name=name, path=path, fingerprint=combined, tokenizer_digest=tok_digest,
            num_layers=int(text.get("num_hidden_layers", 0)), max_positions=int(text.get("max_position_embeddings", 0)),
            weight_bytes=weight_bytes, rope=rope_key(text), config=config,
        )
        self._infos[alias] = info
        return info

    def check_family(self, source_alias: str) -> None:
        """Every declared model must share the source's tokenizer, or its KV cannot be shared."""
        source = self.info(source_alias)
        for alias in self.aliases:
            info = self.info(alias)
            if info.tokenizer_digest != source.tokenizer_digest:
                raise CrossFamilyError(
                    f"model {alias!r} ({info.path}) uses a different tokenizer from the source {source_alias!r} "
                    f"({source.path}): it is not in the same family and cannot share the document cache; "
                    f"remove it or give it its own pipeline"
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
